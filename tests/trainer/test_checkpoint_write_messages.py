"""What a failed save says is left is true in each case (issue 40): nothing of the save and no earlier
checkpoint; the previous checkpoint intact; or the new step's folder complete while the tracker still
names the previous step (or is missing)."""

import errno

import pytest
import torch

from posttrain.checkpoint import CheckpointManager, CheckpointWriteError, RoleState, verify_checkpoint
from posttrain.checkpoint.layout import TRACKER


def _save(root, step):
    return CheckpointManager(root).save(step, {"actor": RoleState(model={"w": torch.ones(2) * step})},
                                        {"global_step": step})


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", "/full")


def _failed_save(root, step):
    with pytest.raises(CheckpointWriteError) as err:
        _save(root, step)
    return str(err.value)


def test_a_first_save_that_fails_says_there_was_no_earlier_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    monkeypatch.setattr("posttrain.checkpoint.layout._write_json", _full_disk)
    message = _failed_save(root, 1)
    assert f"nothing of this save is left in {root}, which holds no earlier checkpoint" in message
    assert "intact" not in message
    assert CheckpointManager(root).step_dirs() == []  # true: nothing left


def test_a_failed_tracker_write_says_the_new_step_is_complete_and_where_a_resume_starts(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    monkeypatch.setattr(CheckpointManager, "_write_tracker", _full_disk)
    message = _failed_save(root, 1)
    assert message.startswith("saving the checkpoint of step 1 failed at its last write, the tracker")
    assert (f"global_step_1 in {root} is complete, but a resume would start from global_step_1, the newest "
            f"complete checkpoint (there is no {TRACKER})") in message
    assert "previous checkpoint" not in message and "nothing of this save" not in message
    assert verify_checkpoint(root / "global_step_1") and CheckpointManager(root).latest() == root / "global_step_1"


def test_a_failed_tracker_write_after_an_earlier_save_names_the_step_a_resume_would_take(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    _save(root, 1)
    monkeypatch.setattr(CheckpointManager, "_write_tracker", _full_disk)
    message = _failed_save(root, 2)
    assert (f"global_step_2 in {root} is complete, but a resume would start from global_step_1, the step {TRACKER} "
            f"still names (trainer.resume_mode=resume_path trainer.resume_from_path={root / 'global_step_2'}") in message
    monkeypatch.undo()
    assert verify_checkpoint(root / "global_step_2") and CheckpointManager(root).latest() == root / "global_step_1"


def test_a_failed_write_after_an_earlier_save_says_that_one_is_intact(tmp_path, monkeypatch):
    """The negative control of the first case: with a checkpoint already there, the message names it."""
    root = tmp_path / "ckpt"
    _save(root, 1)
    monkeypatch.setattr("posttrain.checkpoint.layout._write_json", _full_disk)
    message = _failed_save(root, 2)
    assert f"the previous checkpoint in {root} is intact (global_step_1:" in message
    assert CheckpointManager(root).latest() == root / "global_step_1"
