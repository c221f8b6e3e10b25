"""The README's "From Python" snippet runs as written on a fresh install, with `my_run.yaml` made the
way the README says (`posttrain config --builtin-yaml > my_run.yaml`)."""

import re
from pathlib import Path

from omegaconf import OmegaConf

import posttrain
from helpers.tiny_run import one_thread, tiny_overrides
from posttrain.cli import main as cli
from posttrain.config.load import load_raw

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_python_snippet() -> str:
    """The first ```python block after the line "From Python:"."""
    text = README.read_text(encoding="utf-8")
    after = text[text.index("From Python"):]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def write_my_run_yaml(capsys, folder: Path) -> Path:
    assert cli(["config", "--builtin-yaml"]) == 0
    path = folder / "my_run.yaml"
    path.write_text(capsys.readouterr().out)
    return path


def test_my_run_yaml_from_the_cli_is_the_built_in_run(tmp_path, capsys):
    snippet = readme_python_snippet()
    assert 'posttrain.load_config(path="my_run.yaml", overrides=["algorithm.adv_estimator=grpo"])' in snippet
    path = write_my_run_yaml(capsys, tmp_path)
    overrides = ["algorithm.adv_estimator=grpo"]
    mine = posttrain.load_config(path=path, overrides=overrides, validate=False)
    # what `posttrain train algorithm.adv_estimator=grpo` runs
    builtin = posttrain.load_config(overrides=overrides, base=posttrain.BUILTIN_CONFIG, validate=False)
    assert mine == builtin
    assert mine.data.train_files is None and mine.actor_rollout_ref.model.path == "smollm2-135m-instruct"
    # negative control: no path means verl's defaults (GSM8K files), as the docstring says
    verl = posttrain.load_config(overrides=overrides, validate=False)
    assert verl != builtin and verl.data.train_files == "~/data/rlhf/gsm8k/train.parquet"
    # keys that follow another still follow it in the written file (a resolved dump would freeze them)
    edited = posttrain.load_config(path=path, overrides=["data.max_response_length=40"], validate=False)
    assert edited.actor_rollout_ref.rollout.response_length == 40


def test_the_readme_snippet_runs(tmp_path, capsys, monkeypatch):
    # my_run.yaml: the built-in run's file with the tiny model and data swapped in (SmolLM2 is too slow for a test)
    (tmp_path / "from_cli").mkdir()
    builtin_yaml = write_my_run_yaml(capsys, tmp_path / "from_cli")
    tiny = tiny_overrides(tmp_path, ["trainer.total_training_steps=1"])
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_run.yaml").write_text(OmegaConf.to_yaml(load_raw(builtin_yaml, tiny)))
    monkeypatch.chdir(work)
    namespace: dict = {}
    with one_thread():
        exec(compile(readme_python_snippet(), str(README), "exec"), namespace)
    history, trainer = namespace["history"], namespace["trainer"]
    steps = [h for h in history if h.get("step", 0) >= 1]
    assert len(steps) == 1 and trainer.config.algorithm.adv_estimator == "grpo"
    # the snippet's reward (first response token == 42) scores each of the 4 x 2 responses 0 or 1
    score = steps[0]["critic/score/mean"]
    assert 0 <= score <= 1 and abs(score * 8 - round(score * 8)) < 1e-6
