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


def build(stage: str, folder, keys=STEPS):
    if stage == "rl":
        from posttrain.trainer.trainer import RLTrainer

        return RLTrainer(tiny_config(folder, keys))
    if stage == "sft":
        from posttrain.trainer.sft_trainer import SFTTrainer

        return SFTTrainer(tiny_sft_config(folder, keys))
    from posttrain.trainer.dpo_trainer import DPOTrainer

    return DPOTrainer(tiny_dpo_config(folder, keys))


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


def test_a_resumed_run_measures_its_gain_from_the_first_validation(tmp_path, capsys):
    """Stopped after step 2 and resumed to step 3, the summary's "before" is the validation at step 0 of
    the first run (kept in the checkpoint), not the resumed run's first validation."""
    from posttrain.trainer.report import summarize_run
    from posttrain.trainer.trainer import RLTrainer

    keys = STEPS + ["trainer.val_before_train=True", "trainer.test_freq=1"]
    with one_thread():
        stopped = RLTrainer(tiny_config(tmp_path, keys))
        sigterm_during_step(stopped, at=2)
        first = stopped.fit()
        step0 = {k: v for k, v in first[0].items() if k.startswith("val-")}
        assert first[0]["step"] == 0 and step0 and stopped.first_validation.items() >= step0.items()
        resumed = RLTrainer(tiny_config(tmp_path, keys))
        history = resumed.fit()
    assert [row["step"] for row in history] == [3]
    assert resumed.first_validation.items() >= step0.items()  # read back from the checkpoint
    capsys.readouterr()
    summarize_run(resumed, history)
    out = capsys.readouterr().out
    key = next(k for k in step0 if k.startswith("val-core/"))
    assert f"{key}: {step0[key]:.3f} at step 0 -> {history[-1][key]:.3f} at step 3" in out


@pytest.mark.parametrize("stage", ["rl", "sft", "dpo"])
def test_a_finished_run_started_again_says_so_and_keeps_no_superseded_checkpoint(tmp_path, stage, monkeypatch):
    """Stopped at step 2 (a checkpoint saved on the signal although trainer.save_freq=-1 keeps none), resumed to
    the end: the export supersedes that checkpoint, which goes; the same command again says the run finished,
    before any model loads, instead of resuming from step 2 and training it again."""
    from posttrain.trainer import setup
    from posttrain.trainer.resume import RunFinished

    keys = ["trainer.total_training_steps=3", "trainer.save_freq=-1", "trainer.resume_mode=auto"]
    keys += ["trainer.export_at_end=True"] if stage == "rl" else []  # SFT and DPO save and export their last step
    ckpt = tmp_path / "ckpt"
    with one_thread():
        stopped = build(stage, tmp_path, keys)
        sigterm_during_step(stopped, at=2)
        stopped.fit()
        assert (ckpt / "global_step_2").is_dir()
        assert [row["step"] for row in build(stage, tmp_path, keys).fit()] == [3]
    assert (ckpt / "hf_model" / "config.json").exists() and (ckpt / "finished_run.json").exists()
    kept = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("global_step_"))
    assert kept == ([] if stage == "rl" else ["global_step_3"])  # global_step_2 is gone

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(setup, "build_workers", no_model)
    with pytest.raises(RunFinished) as err:
        build(stage, tmp_path, keys)
    assert f"this run already finished in trainer.default_local_dir={ckpt} (step 3, its model: {ckpt / 'hf_model'})" \
        in str(err.value)
    assert ("raise trainer.total_training_steps" in str(err.value)) == (stage != "rl")  # its last checkpoint is kept


def test_a_run_starting_at_step_0_sets_the_earlier_results_aside(tmp_path, capsys):
    """start_over (or a new run in a run folder an earlier one used) never appends its steps to the earlier
    run's results: its metrics.jsonl, the samples on disk (their index) and the tensorboard events move to
    previous_run_<time>/ in the run folder, with a note; this run's files hold its own steps only."""
    import json

    from posttrain.trainer.trainer import RLTrainer

    run = tmp_path / "run"
    keys = ["trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.export_at_end=True",
            f"trainer.rollout_data_dir={run / 'rollouts'}", "trainer.logger=[file,tensorboard]"]
    with one_thread():
        RLTrainer(tiny_config(tmp_path, keys)).fit()
        RLTrainer(tiny_config(tmp_path, [*keys, "trainer.start_over=True"])).fit()

    def steps(path):
        return [json.loads(line)["step"] for line in path.read_text().splitlines()]

    assert steps(run / "metrics.jsonl") == steps(run / "rollouts" / "index.jsonl") == [1, 2]  # this run's only
    (aside,) = run.glob("previous_run_*")
    assert steps(aside / "metrics.jsonl") == steps(aside / "rollouts" / "index.jsonl") == [1, 2]
    assert len(list((run / "tensorboard").glob("events.*"))) == len(list((aside / "tensorboard").glob("events.*"))) == 1
    assert (f"note: {run} held the results of an earlier run (metrics.jsonl, tensorboard, rollouts); moved to "
            f"{aside}/") in capsys.readouterr().out
