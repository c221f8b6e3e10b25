"""The reward model on 2 CPU ranks (Ray, gloo, FSDP2): each rank scores its own rows with the sharded
frozen model, and a PPO run (actor + critic + reward model, greedy so both world sizes see the same
responses) gives the same numbers as one process."""

from __future__ import annotations

import math

import pytest

ray = pytest.importorskip("ray")

from helpers.tiny_reward_model import tiny_reward_model_dir  # noqa: E402
from helpers.tiny_run import tiny_config  # noqa: E402

COMPARED = ("reward_model/score/mean", "critic/score/mean", "critic/values/mean", "critic/vf_loss", "actor/pg_loss",
            "actor/grad_norm", "critic/advantages/mean")


def ppo_with_reward_model(workdir, ranks: int) -> list[dict]:
    from posttrain.trainer.trainer import RLTrainer

    overrides = [f"trainer.n_gpus_per_node={ranks}", "algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1",
                 "actor_rollout_ref.rollout.do_sample=False", "data.train_batch_size=8",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
                 "trainer.total_training_steps=2", "reward_model.enable=True",
                 f"reward_model.model.path={tiny_reward_model_dir(workdir)}",
                 "reward_model.micro_batch_size_per_gpu=3",  # 4 rows per rank: micro-batches of 3 and 1
                 "reward_model.max_length=400", "reward_model.model.fsdp_config.mixed_precision.param_dtype=fp32"]
    return RLTrainer(tiny_config(workdir, overrides)).fit()


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow  # a 2-rank engine run (~15-30 s on 2 Zen 3 cores): `python -m pytest -m slow`
def test_two_ranks_score_like_one_process(tmp_path_factory, ray_cluster):
    one = ppo_with_reward_model(tmp_path_factory.mktemp("rm1"), 1)
    two = ppo_with_reward_model(tmp_path_factory.mktemp("rm2"), 2)
    assert one[0]["reward_model/score/mean"] != 0 and one[-1]["critic/vf_loss"] > 0  # real numbers to compare
    for got, want in zip(two, one):
        assert got["step"] == want["step"]
        for key in COMPARED:
            assert math.isclose(got[key], want[key], rel_tol=1e-4, abs_tol=1e-5), (got["step"], key, got[key], want[key])
