"""Entry points: `python -m posttrain.trainer.main_ppo key=value ...` (a verl launch script with
`verl` replaced by `posttrain`: verl's defaults, then the overrides) and `posttrain train`
(the built-in default run, then the overrides)."""

from __future__ import annotations

import argparse
import sys

from posttrain.cli_args import yaml_config_file
from posttrain.config import BUILTIN_CONFIG, ConfigError, load_config


def run(config) -> int:
    """Build and train; returns the exit code. A user error prints one ``error:`` line and returns its
    code (1/2/3, `posttrain.errors`); SIGINT/SIGTERM return 128 + the signal number after the run saved
    its checkpoint, so that a scheduler never takes a pre-empted run for a finished one."""
    from posttrain.errors import run_cli

    return run_cli(lambda _: _train(config), [])


def _train(config) -> int:
    from posttrain.trainer.report import summarize_run
    from posttrain.trainer.resume import RunFinished
    from posttrain.trainer.run import startup_signals
    from posttrain.config.async_training import async_enabled
    from posttrain.trainer.trainer import RLTrainer

    try:
        with startup_signals():
            if async_enabled(config):  # actor_rollout_ref.hybrid_engine=False: a separate rollout pool
                from posttrain.trainer.async_trainer import AsyncRLTrainer

                trainer = AsyncRLTrainer(config)
            else:
                trainer = RLTrainer(config)
        history = trainer.fit()
    except KeyboardInterrupt:
        print("\naborted without saving (second Ctrl-C)", file=sys.stderr)
        return 130
    except RunFinished as finished:  # its model is there: a pipeline started again goes on (exit 0)
        print(finished, flush=True)
        return 0
    summarize_run(trainer, history)
    if trainer.stopped_by is not None:
        return 128 + int(trainer.stopped_by)
    return 0


def train_cli(argv: list[str], builtin: bool, prog: str = "python -m posttrain.trainer.main_ppo",
              entry_overrides: tuple[str, ...] = ()) -> int:
    """``entry_overrides``: an entry point's own defaults (posttrain.experimental), before the user's."""
    parser = argparse.ArgumentParser(prog="posttrain train" if builtin else prog,
                                     description="Train with RL. Overrides use verl's keys: key=value ... "
                                     + ("key=value overrides land on the built-in run (posttrain/config/builtin.yaml: "
                                        "SmolLM2-135M-Instruct, one process on CPU); --config FILE starts from verl's "
                                        "defaults instead, as `python -m posttrain.trainer.main_ppo` does." if builtin
                                        else "Starts from verl's defaults, then --config FILE, then the overrides."))
    parser.add_argument("--config", type=yaml_config_file,
                        help="YAML config layered over verl's defaults (replaces the built-in run)")
    parser.add_argument("--cfg", choices=("job", "all"), default=None,
                        help="print the resolved config after its checks and exit without training (Hydra's flag)")
    parser.add_argument("--config-path", dest="hydra_path", help=argparse.SUPPRESS)
    parser.add_argument("--config-name", dest="hydra_name", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_args(argv)
    if args.hydra_path is not None or args.hydra_name is not None:
        raise ConfigError(hydra_config_refusal(args.hydra_path, args.hydra_name))
    base = BUILTIN_CONFIG if builtin and args.config is None else None
    config = load_config(args.config, [*entry_overrides, *args.overrides], base=base)
    if args.cfg is not None:
        return print_config(config)
    from posttrain.config.verl_keys import no_effect_lines

    for line in no_effect_lines(list(config.no_effect)):  # once, before anything loads
        print(f"note: {line}", flush=True)
    return run(config)


def hydra_config_refusal(path: str | None, name: str | None) -> str:
    """One line for Hydra's ``--config-path/--config-name`` (verl's scripts pick another trainer config that way)."""
    named = name or "ppo_trainer"
    for engine in ("megatron", "veomni", "torchtitan", "automodel"):
        if engine in named or engine in (path or ""):
            return (f"--config-name={named}: verl's {engine} trainer config needs verl's {engine} engine; posttrain "
                    "trains with FSDP2 and reads verl's FSDP config (ppo_trainer): drop --config-path/--config-name")
    return (f"--config-path/--config-name ({path or '.'}/{named}) are Hydra's; posttrain reads verl's ppo_trainer "
            "defaults: give a YAML file of overrides with --config FILE")


def print_config(config) -> int:
    """``--cfg job``: the resolved config as YAML, then the verl keys that have no effect here."""
    from posttrain.config import to_yaml
    from posttrain.config.verl_keys import no_effect_lines

    print(to_yaml(config), end="")
    for line in no_effect_lines(config.no_effect):
        print(f"# {line}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m posttrain.trainer.main_ppo``: user errors as one ``error:`` line (``--debug``:
    with the traceback)."""
    from posttrain.errors import run_cli

    return run_cli(lambda a: train_cli(a, builtin=False), list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    from posttrain.host.allocator import bound_kernel_caches
    from posttrain.host.threads import choose_wait_policy

    choose_wait_policy()  # torch is not loaded yet (posttrain.host.threads says why)
    bound_kernel_caches()  # before the first matmul (posttrain.host.allocator says why)
    sys.exit(main())
