"""The run loop every stage shares (`posttrain.trainer.run`), once per stage: a SIGTERM during step 2 of
3 lets that step finish, saves it and stops (``stopped_by``); a new trainer on the same folder resumes
at step 3 and ends with the weights of a run that was never stopped."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from helpers.sft import tiny_dpo_config, tiny_sft_config
from helpers.tiny_run import one_thread, tiny_config

STEPS = ["trainer.total_training_steps=3", "trainer.save_freq=100", "trainer.resume_mode=auto"]


def build(stage: str, folder):
    if stage == "rl":
        from posttrain.trainer.trainer import RLTrainer

        return RLTrainer(tiny_config(folder, STEPS))
    if stage == "sft":
        from posttrain.trainer.sft_trainer import SFTTrainer

        return SFTTrainer(tiny_sft_config(folder, STEPS))
    from posttrain.trainer.dpo_trainer import DPOTrainer

    return DPOTrainer(tiny_dpo_config(folder, STEPS))


def sigterm_during_step(trainer, at: int) -> None:
    """The process receives SIGTERM while step ``at`` trains (the handler the run loop installed runs)."""
    step = trainer.train_step

    def train_step(batch):
        if trainer.global_step == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(batch)

    trainer.train_step = train_step


@pytest.mark.parametrize("stage", ["rl", "sft", "dpo"])
def test_sigterm_saves_the_step_and_the_resume_ends_as_an_unbroken_run(tmp_path, stage):
    with one_thread():
        straight = build(stage, tmp_path / "straight")
        straight.fit()
        stopped = build(stage, tmp_path / "stopped")
        sigterm_during_step(stopped, at=2)
        first = stopped.fit()
        assert [row["step"] for row in first] == [1, 2] and stopped.stopped_by == signal.SIGTERM
        assert (tmp_path / "stopped" / "ckpt" / "global_step_2").is_dir()
        assert not (tmp_path / "stopped" / "ckpt" / "hf_model").exists()  # a stopped run is not a finished one
        resumed = build(stage, tmp_path / "stopped")
        second = resumed.fit()
    assert [row["step"] for row in second] == [3] and resumed.stopped_by is None
    want = straight.workers.actor.module.state_dict()
    for name, value in resumed.workers.actor.module.state_dict().items():
        torch.testing.assert_close(value, want[name])
