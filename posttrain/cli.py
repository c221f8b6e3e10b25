"""`posttrain` command line: one sub-command per entry of `COMMANDS` (``posttrain --help`` lists them).

Each sub-command lives in the module that owns its work; this file only routes.
"""

from __future__ import annotations

import argparse
import sys

from posttrain.commands import PREP_DATASETS
from posttrain.config import BUILTIN_CONFIG


def _config_cmd(argv: list[str]) -> int:
    from posttrain.config import ConfigError, derive_sizes, describe_sizes, load_config, to_yaml
    from posttrain.config.reference import keys_table, markdown_reference
    from posttrain.cli_args import yaml_config_file

    parser = argparse.ArgumentParser(prog="posttrain config", description="Print the resolved config as YAML.")
    parser.add_argument("--config", type=yaml_config_file, help="YAML file layered over the defaults")
    parser.add_argument("--builtin", action="store_true", help="start from the built-in default run instead of verl's defaults")
    parser.add_argument("--builtin-yaml", action="store_true",
                        help="print the built-in run's own YAML (posttrain/config/builtin.yaml), to start a config of your "
                             "own: `posttrain config --builtin-yaml > my_run.yaml`, then `posttrain train --config my_run.yaml` "
                             "or posttrain.load_config(path='my_run.yaml') run the built-in run")
    parser.add_argument("--keys", action="store_true", help="list every key with its default and meaning")
    parser.add_argument("--markdown", action="store_true", help="print the key reference as Markdown (docs/config.md)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as in verl scripts")
    args = parser.parse_args(argv)
    if args.keys:
        print(keys_table())
        return 0
    if args.markdown:
        sys.stdout.write(markdown_reference())
        return 0
    if args.builtin_yaml:
        if args.config or args.builtin or args.overrides:
            raise ConfigError("posttrain config --builtin-yaml prints builtin.yaml as it is and takes no --config, "
                              "--builtin or overrides; edit the file it writes instead")
        sys.stdout.write(BUILTIN_CONFIG.read_text(encoding="utf-8"))
        return 0
    config = load_config(args.config, args.overrides, base=BUILTIN_CONFIG if args.builtin else None)
    # Every key is written resolved: a key that follows another (a `${...}` default) is frozen at its value here,
    # so this output describes a run; a file to edit should start from --builtin-yaml.
    print("# resolved config (keys that follow another are written as values); a YAML to edit: "
          "posttrain config --builtin-yaml")
    print(to_yaml(config), end="")
    print("# derived batch sizes\n" + "\n".join(f"# {line}" for line in describe_sizes(derive_sizes(config)).splitlines()))
    return 0


def _delegate(module: str, argv: list[str]) -> int:
    import importlib

    return int(importlib.import_module(module).main(argv) or 0)


COMMANDS = {
    "train": ("posttrain.trainer.main_ppo", "train with overrides (no arguments: the built-in default run)"),
    "sft": ("posttrain.trainer.fsdp_sft_trainer", "supervised fine-tuning (no arguments: the built-in SFT run)"),
    "dpo": ("posttrain.trainer.fsdp_sft_trainer", "offline DPO on preference pairs (prompt, chosen, rejected)"),
    "config": (None, "print the resolved config, --keys for the key reference"),
    "prep": ("posttrain.commands.prep", f"prepare datasets: {', '.join(PREP_DATASETS)}"),
    "plan": ("posttrain.plan", "explain a run before it starts: batch flow, models, memory, problems"),
    "diff": ("posttrain.diff", "compare two launch scripts or configs key by key"),
    "compare": ("posttrain.commands.compare", "run two configs on the same data and seeds: accuracy, speed, memory"),
    "eval": ("posttrain.trainer.evaluate", "a model or checkpoint on a dataset: verl's mean/best/maj@N, unbiased pass@k, "
                                           "an eval card (--n 8: 8 samples a prompt)"),
    "export": ("posttrain.trainer.export", "write a checkpoint's actor as a Hugging Face folder"),
    "view": ("posttrain.view", "a local web page of runs: curves, samples, tokens, trajectories, eval cards"),
    "serve": ("posttrain.serve.server", "an OpenAI-compatible server over a model: serve MODEL [--port] [--api-key]"),
    "sandbox": ("posttrain.sandbox.server", "serve SandboxFusion's /run_code with the local sandbox: sandbox serve"),
}


def top_level_help() -> str:
    """`posttrain --help`: the commands, and the options every command takes (parsed here, in `main`)."""
    lines = ["usage: posttrain <command> [args] [--debug]", "", "commands:"]
    lines += [f"  {name:8s} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "options (any command, any position):",
              "  --debug  print the Python traceback of a user error too (same as POSTTRAIN_DEBUG=1); without it",
              "           an error is one line, `error: ...`",
              "  -h, --help  this text; `posttrain <command> --help` lists a command's own options", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Route to a sub-command. A user error (any `posttrain.errors.PosttrainError`) prints one
    ``error: ...`` line and returns its exit code; ``--debug`` (anywhere) or ``POSTTRAIN_DEBUG=1``
    adds the traceback."""
    from posttrain.errors import run_cli

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = [a for a in argv if a == "--debug"]
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: unknown command {argv[0]!r}", file=sys.stderr)
        print(top_level_help(), end="")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:] + debug
    if command == "config":
        return run_cli(_config_cmd, rest)
    if command == "train":
        from posttrain.trainer.main_ppo import train_cli

        return run_cli(lambda a: train_cli(a, builtin=True), rest)
    if command in ("sft", "dpo"):
        from posttrain.trainer.fsdp_sft_trainer import dpo_cli, sft_cli

        return run_cli(lambda a: sft_cli(a, builtin=True) if command == "sft" else dpo_cli(a), rest)
    return run_cli(lambda a: _delegate(COMMANDS[command][0], a), rest)


def entry() -> None:
    """Console-script entry: exit quietly when the reader of our output goes away (`| head`)."""
    from posttrain.host.allocator import bound_kernel_caches
    from posttrain.host.threads import choose_wait_policy

    choose_wait_policy()  # before torch loads (posttrain.host.threads says why)
    bound_kernel_caches()  # before the first matmul (posttrain.host.allocator says why)
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    entry()
