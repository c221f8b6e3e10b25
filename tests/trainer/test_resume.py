"""Resume is exact: stopping after step 2 and resuming gives the same steps 3 and 4 as never
stopping, for GRPO (KL loss) and PPO (critic, adaptive in-reward KL controller); a checkpoint saved
at an epoch boundary resumes with the next epoch's first batch (verl #5725 ran zero steps there);
a checkpoint from another config is refused, naming the key.

Fairness of the comparison: both runs use the same `trainer.save_freq=2` schedule (saving does not
touch any RNG, but the schedules are the same anyway). The stopped run is configured for fewer
steps, and `optim.total_training_steps` is filled from the step count, so the LR schedule is the
default *constant* one with no warm-up, for which the step count does not change the LR; the
compared metrics include `actor/lr` (and `critic/lr`), which would show any difference.
"""

import math

import pytest
import torch

from posttrain.config import ConfigError, load_config
from posttrain.checkpoint import CheckpointError, CheckpointManager
from posttrain.trainer.main_ppo import run as run_cli
from helpers.tiny_run import one_thread, tiny_overrides
from posttrain.trainer.trainer import RLTrainer


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield

COMPARED = ("actor/", "critic/", "response_length/")
REL = 1e-5


def _trainer(tmp_path, extra, n_train=64):
    return RLTrainer(load_config(overrides=tiny_overrides(tmp_path, extra, n_train=n_train)))


def _recording(trainer):
    """Record each step's prompt ids (before the step adds anything to the batch)."""
    prompts = {}
    step = trainer.train_step

    def train_step(batch):
        prompts[trainer.global_step] = batch["input_ids"].clone()
        return step(batch)

    trainer.train_step = train_step
    return prompts


def _assert_same_metrics(full_rows, resumed_rows):
    assert [r["step"] for r in full_rows] == [r["step"] for r in resumed_rows]
    for a, b in zip(full_rows, resumed_rows):
        keys = sorted(k for k in a if k.startswith(COMPARED))
        assert keys == sorted(k for k in b if k.startswith(COMPARED)), a["step"]
        assert len(keys) > 10
        bad = {k: (a[k], b[k]) for k in keys if not math.isclose(a[k], b[k], rel_tol=REL, abs_tol=1e-7)}
        assert bad == {}, f"step {a['step']}: {bad}"


# ---------------------------------------------------------------------- GRPO, across an epoch boundary
GRPO = ["actor_rollout_ref.actor.use_kl_loss=True", "trainer.save_freq=2", "trainer.resume_mode=auto",
        "trainer.total_training_steps=null"]


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory):
    """8 prompts / batch 4 = 2 steps per epoch. Uninterrupted: 2 epochs. Interrupted: 1 epoch (saved
    at step 2, exactly at the epoch boundary), then a new trainer with 2 epochs resumes."""
    full_dir, split_dir = tmp_path_factory.mktemp("full"), tmp_path_factory.mktemp("split")
    full = _trainer(full_dir, GRPO + ["trainer.total_epochs=2"], n_train=8)
    full_prompts = _recording(full)
    full_rows = full.fit()
    first_rows = _trainer(split_dir, GRPO + ["trainer.total_epochs=1"], n_train=8).fit()
    resumed = _trainer(split_dir, GRPO + ["trainer.total_epochs=2"], n_train=8)
    resumed_prompts = _recording(resumed)
    resumed_rows = resumed.fit()
    return dict(full_rows=full_rows, full_prompts=full_prompts, first_rows=first_rows, resumed=resumed,
                resumed_rows=resumed_rows, resumed_prompts=resumed_prompts, split_dir=split_dir)


def test_grpo_resume_is_exact(grpo_runs):
    full_rows, resumed_rows = grpo_runs["full_rows"], grpo_runs["resumed_rows"]
    assert [r["step"] for r in full_rows] == [1, 2, 3, 4]
    assert [r["step"] for r in grpo_runs["first_rows"]] == [1, 2]
    _assert_same_metrics(grpo_runs["first_rows"], full_rows[:2])
    _assert_same_metrics(full_rows[2:], resumed_rows)
    assert "actor/kl_loss" in resumed_rows[0] and "actor/lr" in resumed_rows[0]
    # the policy moved between steps (otherwise equality would prove little)
    assert full_rows[2]["actor/kl_loss"] > 0


def test_resume_at_epoch_boundary_runs_next_epoch(grpo_runs):
    full_prompts, resumed_prompts = grpo_runs["full_prompts"], grpo_runs["resumed_prompts"]
    resumed = grpo_runs["resumed"]
    assert resumed.total_steps == 4 and resumed.global_step == 4  # not zero steps (verl #5725)
    assert sorted(full_prompts) == [1, 2, 3, 4] and sorted(resumed_prompts) == [3, 4]
    assert torch.equal(resumed_prompts[3], full_prompts[3])  # step 3 = epoch 1's first batch
    assert torch.equal(resumed_prompts[4], full_prompts[4])
    # epoch 1 is a fresh shuffle of the same 8 prompts
    epoch0 = {tuple(r.tolist()) for s in (1, 2) for r in full_prompts[s]}
    epoch1 = {tuple(r.tolist()) for s in (3, 4) for r in full_prompts[s]}
    assert len(epoch0) == len(epoch1) == 8 and epoch0 == epoch1
    assert not torch.equal(full_prompts[3], full_prompts[1])
    # training/epoch is the epoch of the batch the step trained on
    assert [r["training/epoch"] for r in grpo_runs["full_rows"]] == [0, 0, 1, 1]
    assert [r["training/epoch"] for r in grpo_runs["resumed_rows"]] == [1, 1]


def test_checkpoint_from_other_config_is_refused(grpo_runs, tmp_path, capsys):
    ckpt = grpo_runs["split_dir"] / "ckpt"
    assert CheckpointManager(ckpt).latest().name == "global_step_4"
    other = ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1", "trainer.resume_mode=auto",
             f"trainer.default_local_dir={ckpt}"]
    # refused at start-up, before any model loads (the tiny model is never built)
    with pytest.raises(CheckpointError) as err:
        _trainer(tmp_path, other)
    message = str(err.value)
    assert f"trainer.default_local_dir={ckpt} holds another run's results" in message
    assert "algorithm.adv_estimator=grpo, this run has gae" in message
    assert "trainer.start_over=True" in message
    # the command line prints it as one error line (exit 2), not a traceback
    assert isinstance(err.value, ConfigError)
    assert run_cli(load_config(overrides=tiny_overrides(tmp_path, other))) == 2
    assert f"error: trainer.default_local_dir={ckpt} holds another run's results" in capsys.readouterr().err

    # another batch size: the prompt loader's position cannot carry over
    with pytest.raises(CheckpointError, match="batch_size=4.*batch_size=8"):
        _trainer(tmp_path / "bs", [*GRPO, "data.train_batch_size=8", f"trainer.default_local_dir={ckpt}"],
                 n_train=8).fit()


def test_a_resume_path_checkpoint_of_another_run_is_refused_before_any_model_loads(grpo_runs, tmp_path, monkeypatch):
    """``resume_mode=resume_path`` naming a checkpoint saved by another run (here: GRPO's, into a GAE run with a fresh
    folder): one error naming the path and what differs, before the workers are built; the control: the same
    checkpoint with its own run's settings gets as far as building them."""
    from posttrain.trainer import setup

    def refuse(*args, **kwargs):
        raise AssertionError("the models were loaded")

    monkeypatch.setattr(setup, "build_workers", refuse)
    step = grpo_runs["split_dir"] / "ckpt" / "global_step_4"
    named = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={step}",
             f"trainer.default_local_dir={tmp_path / 'fresh'}"]
    with pytest.raises(CheckpointError) as err:
        _trainer(tmp_path, ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1", *named])
    assert isinstance(err.value, ConfigError)  # one `error:` line, exit 2
    assert str(err.value).startswith(f"trainer.resume_from_path={step} is another run's checkpoint: it was saved with "
                                     "algorithm.adv_estimator=grpo, this run has gae")
    with pytest.raises(AssertionError, match="the models were loaded"):
        _trainer(tmp_path / "own", [*GRPO, *named], n_train=8)


def test_resume_of_a_finished_run_says_so(grpo_runs, tmp_path, capsys):
    ckpt = grpo_runs["split_dir"] / "ckpt"
    # (its own copy of the tiny model: a model folder at another path resumes, with a warning)
    trainer = _trainer(tmp_path, [*GRPO, "trainer.total_epochs=2", f"trainer.default_local_dir={ckpt}"], n_train=8)
    assert trainer.fit() == [] and trainer.global_step == 4
    assert "nothing left to train" in capsys.readouterr().out


# ---------------------------------------------------------------------- PPO: critic + KL controller
PPO = ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1", "algorithm.use_kl_in_reward=True",
       "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=10", "trainer.save_freq=2",
       "trainer.resume_mode=auto"]


def test_ppo_resume_is_exact(tmp_path):
    full_rows = _trainer(tmp_path / "full", PPO + ["trainer.total_training_steps=4"]).fit()
    _trainer(tmp_path / "split", PPO + ["trainer.total_training_steps=2"]).fit()
    resumed = _trainer(tmp_path / "split", PPO + ["trainer.total_training_steps=4"])
    resumed_rows = resumed.fit()
    _assert_same_metrics(full_rows[2:], resumed_rows)
    for key in ("critic/vf_loss", "critic/values/mean", "actor/pg_loss", "actor/reward_kl_penalty_coeff"):
        assert key in resumed_rows[0], key
    # The controller's state matters: by step 3 beta moved well away from its initial value, so a
    # resume that restarted the controller would fail the comparison above.
    coeff = resumed_rows[0]["actor/reward_kl_penalty_coeff"]
    assert abs(coeff - 0.001) > 1e-2 * 0.001, coeff
