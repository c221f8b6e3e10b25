"""Whose results a checkpoint folder holds, decided when the run claims it, before any model loads
(`posttrain.trainer.resume.check_folder_owner`): a finished run started again says so; another run's
results (another algorithm, rollout mode, settings with nothing to go on from, a model with no record)
are refused in one line; start_over moves them aside; a finished run going on with more steps resumes."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_run import tiny_overrides
from posttrain.checkpoint import CheckpointManager, RoleState
from posttrain.config import ConfigError, load_config
from posttrain.trainer import preflight
from posttrain.trainer.resume import (FINGERPRINT_KEY, FINISHED_FILE, HF_MODEL, ResumeError, RunFinished,
                                      config_fingerprint, mark_finished)

RUN = ["trainer.total_training_steps=15", "trainer.resume_mode=auto"]


def _config(tmp_path, extra=()):
    return load_config(overrides=tiny_overrides(tmp_path, [*RUN, *extra]))


def _claim(config) -> CheckpointManager:
    """What a trainer does at start-up; the lock is released again (the test is the only writer)."""
    manager = CheckpointManager(config.trainer.default_local_dir)
    preflight.claim_checkpoint_folder(config, manager, config_fingerprint(config))
    manager.unlock()
    return manager


def _finish(config, model: bool = True):
    """The folder as a finished run leaves it: its model (when kept) and the record."""
    root = CheckpointManager(config.trainer.default_local_dir).root
    root.mkdir(parents=True, exist_ok=True)
    if model:
        (root / HF_MODEL).mkdir()
        (root / HF_MODEL / "config.json").write_text("{}")
    mark_finished(root, 15, config_fingerprint(config, vocab_size=64), root / HF_MODEL if model else None)
    return root


def test_the_same_run_started_again_says_it_finished(tmp_path):
    config = _config(tmp_path)
    root = _finish(config)
    with pytest.raises(RunFinished) as err:
        _claim(config)
    message = str(err.value)
    assert message.startswith(f"this run already finished in trainer.default_local_dir={root} (step 15, its model: "
                              f"{root / HF_MODEL}): nothing left to train.")
    assert "trainer.start_over=True" in message and "\n" not in message
    assert "raise trainer.total_training_steps" not in message  # no checkpoint of the last step to go on from
    assert isinstance(err.value, ConfigError)  # one error line, exit 2


def test_another_rollout_mode_is_another_run(tmp_path):
    root = _finish(_config(tmp_path))
    with pytest.raises(ResumeError) as err:
        _claim(_config(tmp_path, ["trainer.v1.trainer_mode=colocate_async"]))
    message = str(err.value)
    assert message.startswith(f"trainer.default_local_dir={root} holds another run's results: the run that finished "
                              "there at step 15 had asynchronous rollouts")
    assert "=False, this run has True" in message and "trainer.start_over=True" in message
    assert (root / HF_MODEL).exists()  # nothing was touched


def test_other_settings_with_nothing_to_go_on_from_are_another_run(tmp_path):
    root = _finish(_config(tmp_path))
    with pytest.raises(ResumeError, match=r"holds another run's results: .*kept no checkpoint of its last step.*"
                                          r"actor_rollout_ref.actor.optim.lr: 0.001 -> 0.0001"):
        _claim(_config(tmp_path, ["actor_rollout_ref.actor.optim.lr=1e-4"]))
    assert (root / FINISHED_FILE).exists()


def test_a_finished_run_with_its_last_checkpoint_goes_on_with_more_steps(tmp_path, capsys):
    config = _config(tmp_path)
    root = _finish(config)
    CheckpointManager(root).save(15, {"actor": RoleState(model={"w": torch.zeros(2)})},
                                 {"global_step": 15, FINGERPRINT_KEY: config_fingerprint(config, vocab_size=64)})
    with pytest.raises(RunFinished, match="raise trainer.total_training_steps"):
        _claim(config)
    _claim(_config(tmp_path, ["trainer.total_training_steps=20"]))  # resumes from global_step_15
    assert f"the run in {root} finished at step 15; going on from its checkpoint global_step_15" in \
        capsys.readouterr().out


def test_a_model_with_no_record_of_its_run_is_not_overwritten(tmp_path):
    config = _config(tmp_path)
    root = _finish(config)
    (root / FINISHED_FILE).unlink()  # as a run of an older posttrain left it
    with pytest.raises(ResumeError, match=f"trainer.default_local_dir={root} holds hf_model/, the model of an "
                                          "earlier run that left no record of its config"):
        _claim(config)


def test_start_over_moves_the_finished_run_aside(tmp_path):
    config = _config(tmp_path)
    root = _finish(config)
    _claim(_config(tmp_path, ["trainer.start_over=True"]))
    moved = [p for p in root.iterdir() if p.name.startswith("previous_run_")]
    assert len(moved) == 1 and sorted(p.name for p in moved[0].iterdir()) == [FINISHED_FILE, HF_MODEL]
    _claim(config)  # the folder is fresh now
