"""A 2-rank run stopped and resumed ends with the weights of the run that never stopped, bit for bit.

Each rank samples its responses from its own torch generator (seeded ``trainer.seed + rank``), so the
checkpoint must carry every rank's generator state (``rng/rank_<r>.pt``), not one rank's for all.
The runs go through Ray with 2 CPU ranks (gloo, FSDP2) and sampled GRPO responses, whose rewards
differ between samples: another sampling stream gives other responses, rewards and weights.

- uninterrupted: 3 steps, checkpoints at steps 2 and 3, the final actor exported;
- stopped: the same run, sent SIGINT while it scores step 2 (a Ctrl-C): the step is undone, every
  rank's generators are rewound to where step 2 began, and step 1 is saved; a new trainer resumes it
  for steps 2 and 3;
- negative control: the stopped run's checkpoint with rank 0's RNG state written over rank 1's (what
  restoring one rank's state on every rank does), resumed the same way: the weights differ, so the
  equality above could fail.

Each Ray group costs ~20 s to start on 2 idle cores (every rank imports torch and builds its models);
the four groups take over a minute, hence ``slow``.
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch

ray = pytest.importorskip("ray")

from helpers.tiny_run import tiny_config  # noqa: E402

pytestmark = pytest.mark.slow

RUN = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.n=2", "data.train_batch_size=4",
       "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.use_kl_loss=True",
       "trainer.save_freq=2", "trainer.resume_mode=auto", "trainer.seed=7", "trainer.total_training_steps=3"]
STOPPED_AT = 2  # SIGINT while scoring this step: the checkpoint is the step before


def sample_dependent_reward(batch):
    """The share of response tokens divisible by 3: differs between sampled responses."""
    return (batch["responses"] % 3 == 0).float().mean(-1)


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def fit(workdir, stop_at: int | None = None) -> list[dict]:
    """The run in ``workdir`` (resumed when it holds a checkpoint); ``stop_at``: SIGINT to this
    process while the reward of that step is computed."""
    from posttrain.trainer.trainer import RLTrainer

    trainer = RLTrainer(tiny_config(workdir, RUN))

    def reward(batch):
        if trainer.global_step == stop_at:
            os.kill(os.getpid(), signal.SIGINT)  # the trainer's handler raises here: the step is undone
        return sample_dependent_reward(batch)

    trainer.reward_fn = reward
    rows = trainer.fit()
    assert trainer.stopped_by == (signal.SIGINT if stop_at else None)
    return rows


def final_weights(workdir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(workdir / "ckpt" / "hf_model" / "model.safetensors")


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ray_cluster):
    full, stopped = tmp_path_factory.mktemp("full"), tmp_path_factory.mktemp("stopped")
    full_rows = fit(full)
    stopped_rows = fit(stopped, stop_at=STOPPED_AT)
    control = tmp_path_factory.mktemp("control")
    shutil.copytree(stopped, control, dirs_exist_ok=True)  # the stopped run before its resume
    resumed_rows = fit(stopped)
    return dict(full=full, stopped=stopped, control=control, full_rows=full_rows, stopped_rows=stopped_rows,
                resumed_rows=resumed_rows)


def test_a_resumed_two_rank_run_is_bit_exact(runs):
    from safetensors.torch import load_file

    assert [row["step"] for row in runs["full_rows"]] == [1, 2, 3]
    assert [row["step"] for row in runs["stopped_rows"]] == [1]
    assert [row["step"] for row in runs["resumed_rows"]] == [2, 3]
    full, resumed = final_weights(runs["full"]), final_weights(runs["stopped"])
    initial = load_file(runs["full"] / "tiny_model_0" / "model.safetensors")
    moved = max_difference({k: full[k] for k in initial}, initial)
    assert moved > 1e-4, moved  # training changed the weights, so equality means something
    print(f"max |resumed - uninterrupted| = {max_difference(full, resumed):.3g}")
    rng_dir = runs["stopped"] / "ckpt" / f"global_step_{STOPPED_AT - 1}" / "rng"
    assert sorted(p.name for p in rng_dir.iterdir()) == ["rank_0.pt", "rank_1.pt"]
    for key in full:
        assert torch.equal(resumed[key], full[key]), (key, max_difference({key: full[key]}, {key: resumed[key]}))
    for row_full, row_resumed in zip(runs["full_rows"][STOPPED_AT - 1:], runs["resumed_rows"]):
        assert row_resumed["actor/pg_loss"] == row_full["actor/pg_loss"], row_full["step"]


def test_restoring_rank_0s_state_on_every_rank_changes_the_weights(runs):
    """The negative control: the same resume, with rank 1 handed rank 0's generator states."""
    from posttrain.checkpoint import MARKER, _seal, verify_checkpoint

    control = runs["control"]
    step_dir = control / "ckpt" / f"global_step_{STOPPED_AT - 1}"
    manifest = verify_checkpoint(step_dir)
    shutil.copyfile(step_dir / "rng" / "rank_0.pt", step_dir / "rng" / "rank_1.pt")
    (step_dir / MARKER).unlink()
    _seal(step_dir, STOPPED_AT - 1, manifest["roles"])  # a consistent checkpoint again, with the swapped state
    fit(control)
    difference = max_difference(final_weights(runs["full"]), final_weights(control))
    print(f"max |control - uninterrupted| = {difference:.3g}")
    assert difference > 1e-6
