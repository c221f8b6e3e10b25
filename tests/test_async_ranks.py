"""Asynchronous rollouts with the trainer on FSDP2 ranks (issue 39): 2 trainer ranks (Ray actors, gloo) and
1 rollout worker. Rank 0 joins the rollout workers' weight-sync group as its sender; every rank gathers the
sharded weights for a push. With per-batch seeds at staleness 0 (old log-probs recomputed) the run is the
one-process colocated run: the same responses, and losses and weights equal up to the ranks' reduction order."""

from __future__ import annotations

import math

import pytest
import torch

ray = pytest.importorskip("ray")

from helpers.tiny_run import digit_count_reward, record_pushes, tiny_config  # noqa: E402

COMPARED = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "critic/advantages/mean")


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)  # 2 trainer ranks + 1 rollout worker
    yield
    ray.shutdown()


def _dirs(tmp_path, name):
    return [f"trainer.default_local_dir={tmp_path / name / 'ckpt'}", f"trainer.run_dir={tmp_path / name / 'run'}"]


LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8", "actor_rollout_ref.actor.optim.lr=5e-2"]


@pytest.mark.slow  # 2 Ray trainer ranks, a rollout worker, then a one-process run (~40 s each on 2 busy cores)
@pytest.mark.parametrize("weights", ["full", "lora"])
def test_two_trainer_ranks_at_staleness_zero_are_the_colocated_run(tmp_path, ray_cluster, weights):
    """LoRA: rank 0 sends the adapter alone, and the rollout worker's base weights never move."""
    from posttrain.trainer.async_trainer import AsyncRLTrainer
    from posttrain.trainer.trainer import RLTrainer

    common = ["trainer.total_training_steps=3", "actor_rollout_ref.rollout.seed_per_batch=True"]
    common += LORA if weights == "lora" else []
    trainer = AsyncRLTrainer(tiny_config(tmp_path, common + _dirs(tmp_path, "async") + [
        "trainer.n_gpus_per_node=2", "actor_rollout_ref.hybrid_engine=False",
        "actor_rollout_ref.rollout.n_gpus_per_node=1", "async_training.staleness_threshold=0",
        "async_training.compute_prox_log_prob=True", "async_training.use_rollout_log_probs=False"]))
    trainer.reward_fn = digit_count_reward
    trainer.samples_used = []
    pushed = record_pushes(trainer)
    history = trainer.fit()
    assert [row["weight_sync/version"] for row in history] == [1.0, 2.0, 3.0]

    one = RLTrainer(tiny_config(tmp_path, common + _dirs(tmp_path, "one")))
    one.reward_fn = digit_count_reward
    samples, generate, after_step = [], one.workers.generate_sequences, []
    one.workers.generate_sequences = lambda prompts, validate=False: samples.append(generate(prompts)) or samples[-1]
    step = one.step

    def step_and_read():
        metrics = step()
        after_step.append({k: v.detach().clone() for k, v in one.workers.actor.module.state_dict().items()})
        return metrics

    one.step = step_and_read
    reference = one.fit()
    for got, want in zip(trainer.samples_used, samples):
        assert torch.equal(got["responses"], want["responses"])  # the rollout worker sampled what one process did
    assert any(abs(row["actor/pg_loss"]) > 1e-6 for row in reference)
    for got, want in zip(history, reference):
        for key in COMPARED:
            assert math.isclose(got[key], want[key], rel_tol=1e-4, abs_tol=1e-5), (got["step"], key, got[key], want[key])
    initial = pushed[0].keys()
    tol = 1e-4 if weights == "lora" else 1e-5  # LoRA's lr is 50x the full run's: reduction order moves more
    for worker, expected in zip(pushed, after_step):  # what rank 0 sent after each update is that update's weights
        assert worker.keys() == initial
        assert max((worker[k] - expected[k]).abs().max().item() for k in worker) < tol
    moved = max((after_step[-1][k] - after_step[0][k]).abs().max().item() for k in initial)
    assert moved > 10 * tol  # negative control: the steps moved the weights by far more than the tolerance
    adapters = [k for k in initial if ".lora_" in k]
    assert bool(adapters) == (weights == "lora")
    if adapters:
        assert trainer.lora_only and history[0].get("weight_sync/bytes", 1) > 0
        base = [k for k in initial if ".lora_" not in k]
        assert max((pushed[-1][k] - pushed[0][k]).abs().max().item() for k in base) == 0.0
