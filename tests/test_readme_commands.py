"""The README's commands run as written (issue 40), so the README cannot drift from the code.

The commands are the lines starting with ``posttrain ``, ``bash examples/`` or ``python -m posttrain`` in
the fenced blocks under "## Quick start", "## SFT and DPO" and "## Multi-turn rollouts with tools"
(`helpers.launch_lines.readme_commands`). A line written with a stand-in for what the reader supplies
(``...``, ``/path/to/...``) is planned but not run.

- Default suite: each command parses and plans quickly. A training command (also each one an example
  script would run, read by running the script with a recorder in place of ``posttrain``/``python``)
  loads its config the way the command does, every key valid, and asks for one process; ``plan``,
  ``diff`` and ``config`` run; the other sub-commands' arguments parse.
- ``-m slow``: each command runs as written, in README order in one working folder, shortened only by
  overrides appended to the line (``trainer.total_training_steps=1``, no validation before training,
  ``--n 8`` for eval, ...) and by the size variables the example scripts document (``SFT_STEPS`` ...).

Also here: every example writes its own checkpoint folder, and the README's Python snippet trains with
a reward that scores the built-in task.
"""

from __future__ import annotations

import inspect
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.launch_lines import (REPO, README, example_workdir, plan_invocation, ranks_of, readme_commands,
                                  script_invocations, split_args, stage_of)

HEADINGS = ("## Quick start", "## SFT and DPO", "## Multi-turn rollouts with tools")
COMMANDS = readme_commands(HEADINGS)
SCRIPT_SIZES = {"SFT_STEPS": "1", "GRPO_STEPS": "1", "PROMPTS": "32", "SAMPLES": "4", "N_EVAL": "4"}


def _id(command) -> str:
    return re.sub(r"\W+", "_", command.text[:70]).strip("_")


def test_each_heading_has_commands():
    by_heading = {h: [c for c in COMMANDS if c.section == h] for h in HEADINGS}
    assert all(by_heading.values()), {h: len(c) for h, c in by_heading.items()}
    assert any(c.text.startswith("posttrain sft") for c in COMMANDS)
    # negative control of the reader: a command outside the headings is not picked up
    fake = "# T\n\n## Quick start\n\n```bash\nposttrain train \\\n    a=1  # c\n```\n\n## Other\n\n```bash\nposttrain sft\n```\n"
    found = readme_commands(("## Quick start",), fake)
    assert [c.text for c in found] == ["posttrain train a=1  # c"] and found[0].argv == ["posttrain", "train", "a=1"]


# ---------------------------------------------------------------------------------------------- fast
def check_training(argv: list[str], placeholder: bool) -> None:
    from posttrain.config.sft import SFTConfig
    from posttrain.config.sft_load import ranks

    config = plan_invocation(argv)  # raises ConfigError naming a bad key
    world = ranks(config) if isinstance(config, SFTConfig) else ranks_of(config)
    if not placeholder:  # "..." stands for the rest of a verl script (its ranks too)
        assert world == 1, f"{shlex.join(argv)}: asks for {world} ranks; the README's commands run in one process"


def check_other(argv: list[str], capsys) -> None:
    from posttrain.cli import COMMANDS as SUBCOMMANDS
    from posttrain.cli import main as cli

    if argv[0] == "python":
        assert (REPO / argv[1]).is_file() or argv[1] in ("-c",), argv
        return
    sub = argv[1]
    assert sub in SUBCOMMANDS, argv
    if sub == "plan":
        plan_config(argv[2:])
        return
    if sub in ("diff", "config"):
        assert cli(argv[1:]) == 0, capsys.readouterr()
        return
    if sub == "prep":
        from posttrain.commands.prep import build_parser
    elif sub == "eval":
        from posttrain.trainer.evaluate import build_parser
    elif sub == "export":
        from posttrain.trainer.export import build_parser
    else:
        return
    build_parser().parse_args(argv[2:])  # SystemExit(2) with argparse's message when they do not parse


def plan_config(args: list[str]) -> None:
    """`posttrain plan ARGS`'s config, loaded as plan loads it (its model-shape and memory steps are
    `posttrain plan`'s own tests; here: the arguments parse and every key is valid)."""
    if args and args[0] in ("sft", "dpo"):
        check_training(["posttrain", *args], placeholder=False)
        return
    from posttrain.plan import _parser, _source, load_source

    source, overrides = _source(_parser().parse_args(args))
    load_source(source, overrides, validate=True)


@pytest.mark.parametrize("command", COMMANDS, ids=[_id(c) for c in COMMANDS])
def test_each_command_plans_in_one_process(command, tmp_path, monkeypatch, capsys):
    argv = command.argv
    if argv[0] == "bash":
        invocations = script_invocations(argv, tmp_path)
        monkeypatch.chdir(tmp_path / "main")  # the scripts' relative paths, as they ran
        assert invocations, f"{command.text}: ran no posttrain command"
    else:
        invocations = [argv]
        monkeypatch.chdir(REPO)
    for invocation in invocations:
        if stage_of(invocation) is not None:
            check_training(invocation, command.placeholder)
        else:
            check_other(invocation, capsys)


def test_the_dpo_line_of_the_readme_is_one_process_and_was_eight():
    """The line of the issue: `posttrain dpo key=value` starts from the built-in DPO run (one process);
    the same overrides on verl's defaults (--config, python -m) ask for 8 ranks, as verl does."""
    from posttrain.config.sft_load import load_dpo_config, ranks

    line = "posttrain dpo data.train_files=pairs.parquet model.partial_pretrain=smollm2-135m-instruct dpo.beta=0.1"
    assert ranks(plan_invocation(shlex.split(line))) == 1
    assert ranks(load_dpo_config(overrides=shlex.split(line)[2:], validate=False)) == 8


@pytest.mark.parametrize("command, base", [("sft", "sft_builtin.yaml"), ("dpo", "dpo_builtin.yaml"),
                                           ("train", "builtin.yaml")])
def test_help_says_where_a_command_starts(command, base, capsys):
    from posttrain.cli import main as cli

    with pytest.raises(SystemExit):
        cli([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"posttrain/config/{base}" in text and "verl's" in text and "--config" in text


# ---------------------------------------------------------------------------------------------- examples
def example_runs(tmp_path: Path) -> dict[str, list[str]]:
    """Every training command of every example (scripts as they run with their defaults, YAML configs
    as `posttrain train --config FILE`) and the built-in runs, with its checkpoint folder."""
    runs = {}
    for script in sorted((REPO / "examples").glob("*.sh")):
        for i, argv in enumerate(script_invocations(["bash", f"examples/{script.name}"], tmp_path)):
            if stage_of(argv) is not None:
                runs[f"{script.name}#{i}"] = argv
    for yaml in sorted((REPO / "examples").glob("*.yaml")):
        runs[yaml.name] = ["posttrain", "train", "--config", str(yaml)]
    for stage in ("train", "sft", "dpo"):
        runs[f"posttrain {stage}"] = ["posttrain", stage]
    return runs


def test_every_example_writes_its_own_checkpoint_folder(tmp_path, monkeypatch):
    folders: dict[str, list[str]] = {}
    runs = example_runs(tmp_path)
    monkeypatch.chdir(tmp_path / "main")  # where the scripts ran (their relative paths)
    for name, argv in runs.items():
        path, overrides = split_args(argv)
        loaded = _load_unvalidated(stage_of(argv), path, overrides)
        folders.setdefault(str(Path(loaded.trainer.default_local_dir).expanduser()), []).append(name)
    shared = {folder: names for folder, names in folders.items() if len(names) > 1}
    assert not shared, f"examples that write the same checkpoint folder: {shared}"
    assert len(folders) >= 10  # the scripts' stages, the YAML examples and the built-in runs were all found


def _load_unvalidated(stage: str, path, overrides):
    from posttrain.config import BUILTIN_CONFIG, load_config
    from posttrain.config.sft_load import BUILTIN_DPO, BUILTIN_SFT, load_dpo_config, load_sft_config

    if stage.startswith("train"):
        return load_config(path, overrides, base=BUILTIN_CONFIG if stage == "train" else None, validate=False)
    if stage.startswith("sft"):
        return load_sft_config(path, overrides, base=BUILTIN_SFT if stage == "sft" else None, validate=False)
    return load_dpo_config(path, overrides, base=BUILTIN_DPO if stage == "dpo" else None, validate=False)


def test_example_scripts_pass_extra_overrides_on():
    """Each script hands the arguments after its name to a training command ("$@", quoted)."""
    for script in sorted((REPO / "examples").glob("*.sh")):
        text = script.read_text()
        assert '"$@"' in text, f"{script.name} does not pass its arguments on as \"$@\""
        assert not re.search(r"(?<![\"'])\$@", text), f"{script.name} has an unquoted $@"


# ---------------------------------------------------------------------------------------------- Python API
def readme_python_snippet() -> str:
    text = README.read_text(encoding="utf-8")
    return re.search(r"```python\n(.*?)```", text[text.index("From Python"):], re.S).group(1)


def run_snippet(work: Path, my_run_yaml: str) -> dict:
    (work / "my_run.yaml").write_text(my_run_yaml)
    namespace: dict = {}
    cwd = os.getcwd()
    os.chdir(work)
    try:
        exec(compile(readme_python_snippet(), str(README), "exec"), namespace)
    finally:
        os.chdir(cwd)
    return namespace


def test_the_python_snippet_reward_scores_the_built_in_task(tmp_path):
    """The snippet's reward is a compute_score that agrees with the built-in task's scorer on right and
    wrong worked answers of the held-out rows (it is not the always-0 reward the README once had)."""
    from omegaconf import OmegaConf

    from helpers.tiny_run import one_thread, tiny_overrides
    from posttrain.config import BUILTIN_CONFIG
    from posttrain.config.load import load_raw
    from posttrain.data.arithmetic import write_arithmetic_parquet
    from posttrain.rewards.dispatch import default_compute_score

    tiny = tiny_overrides(tmp_path, ["trainer.total_training_steps=1"])
    with one_thread():
        namespace = run_snippet(tmp_path, OmegaConf.to_yaml(load_raw(BUILTIN_CONFIG, tiny)))
    assert [row["step"] for row in namespace["history"]] == [1]
    scorer = getattr(namespace["trainer"].reward_fn, "compute_score", None)  # the function the snippet set
    assert scorer is not None and "solution_str" in inspect.signature(scorer).parameters, \
        "the snippet's reward is not a compute_score of the built-in task (the old one, token 42, was always 0)"
    write_arithmetic_parquet(str(tmp_path / "task"), n_train=4, n_test=32, digits=2, ops=("+",), seed=0)
    import pandas as pd

    rows = pd.read_parquet(tmp_path / "task" / "test.parquet")
    for _, row in rows.iterrows():
        truth = row["reward_model"]["ground_truth"]
        for reply in (f"The sum is {truth}\n#### {truth}", f"#### {int(truth) + 1}", "I do not know"):
            reference = default_compute_score(row["data_source"], reply, truth)
            reference = reference["score"] if isinstance(reference, dict) else reference
            assert scorer(row["data_source"], reply, truth) == float(reference > 0), (reply, truth)
        assert scorer(row["data_source"], f"#### {truth}", truth) == 1.0  # the reward is not constant 0


@pytest.mark.slow
def test_the_python_snippet_trains_with_a_reward_that_is_not_zero(tmp_path):
    """The snippet as written on the built-in run's own YAML (SmolLM2, 1 step): the reward is not 0."""
    from omegaconf import OmegaConf

    from posttrain.config import BUILTIN_CONFIG
    from posttrain.config.load import load_raw

    steps = ["trainer.total_training_steps=1", "trainer.val_before_train=False", "trainer.test_freq=-1",
             f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.run_dir={tmp_path / 'run'}"]
    namespace = run_snippet(tmp_path, OmegaConf.to_yaml(load_raw(BUILTIN_CONFIG, steps)))
    (step,) = [row for row in namespace["history"] if row["step"] == 1]
    assert 0 < step["critic/score/mean"] <= 1  # the old snippet's reward was 0 on every response


# ---------------------------------------------------------------------------------------------- slow: as written
def shortening(command, argv: list[str], work: Path) -> list[str]:
    """The overrides appended to a line: fewer steps, no validation before training, fewer eval rows."""
    if argv[0] == "bash":  # the stage that receives the script's "$@"
        stages = [stage_of(a) for a in script_invocations([*argv, "SENTINEL=1"], work.parent / "expand", SCRIPT_SIZES)
                  if "SENTINEL=1" in a]
        stage = stages[0] if stages else None
    else:
        stage = stage_of(argv)
    if argv[:2] == ["posttrain", "eval"]:
        return ["--n", "8"]
    if stage is None:
        return []
    if stage.startswith("train"):
        block = [c.text for c in COMMANDS if c.section == command.section and c.block == command.block]
        steps = max([int(n) for text in block for n in re.findall(r"global_step_(\d+)", text)] or [1])
        return [f"trainer.total_training_steps={steps}", "trainer.val_before_train=False", "trainer.test_freq=-1"]
    extra = ["trainer.total_training_steps=1", "data.val_max_samples=16"]
    return extra + (["data.train_batch_size=4", "data.micro_batch_size_per_gpu=4"] if stage.startswith("dpo") else [])


@pytest.fixture(scope="module")
def readme_workdir(tmp_path_factory):
    """One working folder for the whole README, as a reader's checkout (examples/, ../shared), with the
    pairs file the DPO line names."""
    from helpers.sft import write_pairs

    work = example_workdir(tmp_path_factory.mktemp("readme"))
    write_pairs(work / "pairs.parquet", 24)
    return work


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS, ids=[_id(c) for c in COMMANDS])
def test_each_command_runs_as_written(command, readme_workdir):
    if command.placeholder:
        pytest.skip("written with a stand-in for the reader's own value")
    extra = shortening(command, command.argv, readme_workdir)
    line = shlex.join(command.argv + extra)  # the line's own words (its comment dropped), then the shortening
    env = {**os.environ, **SCRIPT_SIZES, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           # this checkout, whatever folder an installed copy points to
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    if command.argv[:3] == ["posttrain", "sandbox", "serve"]:
        proc = serve_then_stop(line, readme_workdir, env)
    else:
        proc = subprocess.run(["bash", "-c", line], cwd=readme_workdir, env=env, capture_output=True, text=True,
                              timeout=3600)
    took = time.monotonic() - start
    with open(readme_workdir / "timings.txt", "a") as log:
        log.write(f"{took:7.1f} s  rc={proc.returncode}  {line}\n")
    with open(readme_workdir / "outputs.txt", "a") as log:  # each command's last lines, for the record
        log.write(f"$ {line}\n" + "\n".join(proc.stdout.splitlines()[-12:]) + "\n\n")
    assert proc.returncode == 0, f"{line}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"



def serve_then_stop(line: str, work: Path, env: dict) -> subprocess.CompletedProcess:
    """A server runs until stopped: it passes when its port answers /run_code, then it gets SIGTERM."""
    import json
    import signal
    import urllib.request

    port = int(shlex.split(line)[shlex.split(line).index("--port") + 1])
    server = subprocess.Popen(shlex.split(line), cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    answered, deadline = None, time.monotonic() + 300
    while answered is None and time.monotonic() < deadline and server.poll() is None:
        try:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/run_code", method="POST",
                                             data=json.dumps({"code": "print(6 * 7)", "language": "python"}).encode(),
                                             headers={"Content-Type": "application/json"})
            answered = json.loads(urllib.request.urlopen(request, timeout=60).read())
        except OSError:
            time.sleep(1)
    server.send_signal(signal.SIGTERM)
    out, _ = server.communicate(timeout=120)
    ok = answered is not None and "42" in json.dumps(answered)
    return subprocess.CompletedProcess(line, 0 if ok else 1, out, f"answer: {answered}")
