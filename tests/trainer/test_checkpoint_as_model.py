"""Issue 59: a checkpoint folder given where a model folder is expected is named as a checkpoint, with the model
folder to use or the `posttrain export` command that writes one (not "a folder without config.json")."""

from __future__ import annotations

import re

import pytest

from helpers.tiny_run import one_thread, tiny_model_dir
from posttrain.checkpoint import CheckpointManager, RoleState
from posttrain.errors import ConfigError
from posttrain.trainer.preflight import model_path_problem


@pytest.fixture
def root(tmp_path):
    """A checkpoint root holding a complete global_step_3 (a tiny actor)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with one_thread():
        src = tiny_model_dir(tmp_path)
        model, tok = AutoModelForCausalLM.from_pretrained(src), AutoTokenizer.from_pretrained(src)
        root = tmp_path / "ckpt"
        CheckpointManager(root).save(3, {"actor": RoleState(model=model.state_dict(), hf_config=model.config,
                                                            tokenizer=tok)}, {"step": 3})
    return root


def test_each_form_of_a_checkpoint_is_named_with_the_export_command(root):
    for given in (root, root / "global_step_3", root / "global_step_3" / "actor"):
        assert model_path_problem(str(given)) == (
            f"{given} is a posttrain checkpoint (global_step_3), not a Hugging Face model folder; "
            f"`posttrain export {given} --output DIR` writes one from its actor")
    plain = root.parent / "plain_folder"
    plain.mkdir()
    assert model_path_problem(str(plain)) == f"{plain} is a folder without config.json (not a Hugging Face model folder)"


def test_a_run_folder_names_its_final_model(root):
    (root / "hf_model").mkdir()
    (root / "hf_model" / "config.json").write_text("{}")
    assert model_path_problem(str(root)) == (f"{root} is a run's checkpoint folder, not a model folder; the run's "
                                             f"final model is {root / 'hf_model'}")


def test_eval_of_a_root_without_a_complete_checkpoint_says_why(root, tmp_path, capsys):
    from posttrain.trainer.evaluate import main

    (root / "global_step_3" / "COMPLETE").unlink()  # a save that did not finish
    assert main(["--model", str(root), "--output", str(tmp_path / "cards")]) == 2
    err = capsys.readouterr().err
    assert (f"error: --model {root}: {root} is a posttrain checkpoint, not a Hugging Face model folder, and holds no "
            f"complete one ({root / 'global_step_3'} has no readable COMPLETE marker") in err, err


def test_train_serve_and_plan_name_the_checkpoint(root, tmp_path, capsys):
    from posttrain.config import BUILTIN_CONFIG, load_config
    from posttrain.plan import main as plan
    from posttrain.serve.server import build_engine
    from posttrain.trainer.preflight import check_model_paths

    expected = f"{root} is a posttrain checkpoint (global_step_3), not a Hugging Face model folder; `posttrain export"
    config = load_config(overrides=[f"actor_rollout_ref.model.path={root}"], base=BUILTIN_CONFIG, validate=False)
    assert check_model_paths(config) == [f"actor_rollout_ref.model.path={root}: {expected} {root} --output DIR` "
                                         "writes one from its actor"]
    with pytest.raises(ConfigError, match=re.escape(f"posttrain serve {root}: {expected}")):
        build_engine("hf", str(root))
    assert plan(["--model-config", str(root)]) == 2
    assert f"error: {expected}" in capsys.readouterr().err
