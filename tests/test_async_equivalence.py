"""Asynchronous rollouts against the synchronous trainer (issue 39), 1 rollout worker + 1 trainer on gloo.

With staleness_threshold=0 and a push after every update the async run is the synchronous algorithm on
separate workers: the samples it trained on, replayed into RLTrainer.train_step, give the same losses
and the same final weights, and after every push the rollout worker holds exactly the trainer's weights.
Also: a checkpoint taken with samples in flight resumes at the next step (nothing repeated or skipped),
and a LoRA run's adapter reaches the rollout worker with its version (without a push it does not).
"""

from __future__ import annotations

import math

import pytest
import torch

ray = pytest.importorskip("ray")

from helpers.tiny_run import digit_count_reward, tiny_config  # noqa: E402

ASYNC = ["actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.rollout.n_gpus_per_node=1",
         "trainer.total_training_steps=3"]
SYNC0 = ["async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1"]
COMPARED = ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "critic/score/mean", "critic/advantages/mean")


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _runs_dirs(tmp_path, name):
    return [f"trainer.default_local_dir={tmp_path / name / 'ckpt'}", f"trainer.run_dir={tmp_path / name / 'run'}"]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow  # ~40 s on 2 busy cores (a Ray rollout worker starts, then the sync run)
def test_staleness_zero_equals_sync_run_on_replayed_samples(tmp_path, ray_cluster):
    from posttrain.trainer.async_trainer import AsyncRLTrainer
    from posttrain.trainer.trainer import RLTrainer

    trainer = AsyncRLTrainer(tiny_config(tmp_path, ASYNC + SYNC0 + _runs_dirs(tmp_path, "async")))
    trainer.reward_fn = digit_count_reward
    trainer.samples_used = []
    initial = {k: v.detach().clone() for k, v in trainer.workers.actor.module.state_dict().items()}
    after_push, push = [], trainer._push

    def push_and_compare():
        metrics = push()
        worker = trainer.pool.call(0, "weights")
        mine = {k: v.detach() for k, v in trainer.workers.actor.module.state_dict().items()}
        after_push.append((_max_diff(worker, mine), _max_diff(mine, initial)))
        return metrics

    trainer._push = push_and_compare
    history = trainer.fit()
    assert [row["weight_sync/version"] for row in history] == [1.0, 2.0, 3.0]
    assert all(row["fully_async/count/stale_samples_processed"] == 0 for row in history)  # staleness 0
    assert all(row["fully_async/count/stale_samples_dropped"] == 0 for row in history)
    assert len(after_push) == 3
    for worker_gap, moved in after_push:
        assert moved > 1e-4  # the trainer's weights changed, so the equality means a real copy
        assert worker_gap == 0.0

    sync = RLTrainer(tiny_config(tmp_path, ASYNC[2:] + _runs_dirs(tmp_path, "sync")
                                 + ["algorithm.rollout_correction.bypass_mode=True"]))
    sync.reward_fn = digit_count_reward
    replay = iter(trainer.samples_used)
    sync.workers.generate_sequences = lambda prompts, validate=False: next(replay)
    reference = sync.fit()
    assert any(abs(row["actor/pg_loss"]) > 1e-6 for row in reference)  # non-trivial losses are compared
    for got, want in zip(history, reference):
        for key in COMPARED:
            assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=1e-6), (got["step"], key, got[key], want[key])
    final_async = trainer.workers.actor.module.state_dict()
    final_sync = sync.workers.actor.module.state_dict()
    assert _max_diff(final_async, final_sync) < 1e-6


@pytest.mark.slow  # two async runs (~60 s on 2 busy cores)
def test_checkpoint_with_samples_in_flight_resumes_at_the_next_step(tmp_path, ray_cluster):
    from posttrain.trainer.async_trainer import AsyncRLTrainer

    one_step_off = ["async_training.staleness_threshold=1", "trainer.save_freq=2", "trainer.total_training_steps=3"]
    first = AsyncRLTrainer(tiny_config(tmp_path, ASYNC + one_step_off + _runs_dirs(tmp_path, "ckpt")))
    first.samples_used = []
    history = first.fit()
    assert [row["step"] for row in history] == [1, 2, 3]
    saved = tmp_path / "ckpt" / "ckpt" / "global_step_2"
    assert saved.exists()

    resumed = AsyncRLTrainer(tiny_config(tmp_path, ASYNC + one_step_off + _runs_dirs(tmp_path, "ckpt") + [
        "trainer.total_training_steps=4", "trainer.resume_mode=resume_path", f"trainer.resume_from_path={saved}"]))
    resumed.samples_used = []
    later = resumed.fit()
    assert [row["step"] for row in later] == [3, 4]  # continues after the saved step: none repeated or skipped
    assert resumed.weight_version == 4  # restored version 2, then one push per update
    # the batch in flight at the save (the first run's step 3) is generated again for step 3, not skipped
    assert torch.equal(resumed.samples_used[0]["prompts"], first.samples_used[2]["prompts"])
    assert not torch.equal(resumed.samples_used[1]["prompts"], first.samples_used[2]["prompts"])


@pytest.mark.slow  # one LoRA async run (~40 s on 2 busy cores)
def test_lora_adapter_reaches_the_rollout_worker_with_its_version(tmp_path, ray_cluster):
    from posttrain.trainer.async_trainer import AsyncRLTrainer

    lora = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
            "actor_rollout_ref.actor.optim.lr=5e-2"]
    trainer = AsyncRLTrainer(tiny_config(tmp_path, ASYNC + SYNC0 + lora + _runs_dirs(tmp_path, "lora")))
    trainer.reward_fn = digit_count_reward
    trainer.samples_used = []
    try:
        for step in (1, 2):
            trainer.global_step = step
            trainer.step()
        assert trainer.last_sample_versions == [1]  # step 2's samples came from the adapter pushed after step 1
        mine = {k: v.detach() for k, v in trainer.workers.actor.module.state_dict().items()}
        theirs = trainer.pool.call(0, "weights")
        adapters = [k for k in mine if ".lora_" in k]
        assert adapters and max((mine[k] - theirs[k]).abs().max().item() for k in adapters) == 0.0
        batch = trainer.samples_used[-1]
        own = trainer.workers.actor.compute_log_prob(batch, calculate_entropy=False)[0]
        torch.testing.assert_close(trainer.pool.call(0, "log_probs", batch), own, rtol=1e-5, atol=1e-5)

        trainer._push = lambda: {}  # negative control: an update that is never pushed
        trainer.global_step = 3
        trainer.step()
        own = trainer.workers.actor.compute_log_prob(batch, calculate_entropy=False)[0]
        stale = trainer.pool.call(0, "log_probs", batch)
        assert (stale - own).abs().max().item() > 1e-3
    finally:
        trainer.close()


@pytest.mark.slow  # a multi-turn async run and its replay (~60 s on 2 busy cores)
def test_multi_turn_staleness_zero_equals_sync_run_on_replayed_trajectories(tmp_path, ray_cluster):
    """The same with the arithmetic "try again" interaction: trajectories of several turns whose feedback
    tokens are masked out of ``response_mask``, generated on the rollout worker and streamed back."""
    from posttrain.data.arithmetic import write_arithmetic_parquet
    from posttrain.trainer.async_trainer import AsyncRLTrainer
    from posttrain.trainer.trainer import RLTrainer

    train, test = write_arithmetic_parquet(str(tmp_path / "retry"), n_train=32, n_test=4, digits=1, ops=("+",),
                                           prompt_style="retry")
    interaction = tmp_path / "interaction.yaml"
    interaction.write_text("interaction:\n  - name: arithmetic\n    class_name: "
                           "posttrain.interactions.arithmetic_interaction.ArithmeticInteraction\n    config: {}\n")
    model = _short_turns_model(tmp_path)
    retry = [f"data.train_files={train}", f"data.val_files={test}", "data.max_prompt_length=512",
             "data.max_response_length=160", f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.multi_turn.enable=True",
             f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={interaction}",
             "actor_rollout_ref.rollout.multi_turn.max_user_turns=2", "actor_rollout_ref.actor.use_kl_loss=True"]
    trainer = AsyncRLTrainer(tiny_config(tmp_path, ASYNC + SYNC0 + retry + _runs_dirs(tmp_path, "async")))
    trainer.reward_fn = digit_count_reward
    trainer.samples_used = []
    history = trainer.fit()
    feedback = [((b["attention_mask"][:, -160:] == 1) & (b["response_mask"] == 0)).any().item()
                for b in trainer.samples_used]
    assert all(feedback)  # every step's trajectories hold interaction turns inside the responses
    assert all(row["multi_turn/turns/mean"] > 2 for row in history)  # the interaction answered

    sync = RLTrainer(tiny_config(tmp_path, ASYNC[2:] + retry + _runs_dirs(tmp_path, "sync")
                                 + ["algorithm.rollout_correction.bypass_mode=True"]))
    sync.reward_fn = digit_count_reward
    replay = iter(trainer.samples_used)
    sync.workers.generate_sequences = lambda prompts, validate=False: next(replay)
    reference = sync.fit()
    assert any(abs(row["actor/pg_loss"]) > 1e-6 for row in reference)
    for got, want in zip(history, reference):
        for key in COMPARED + ("actor/kl_loss", "multi_turn/turns/mean"):
            assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=1e-6), (got["step"], key, got[key], want[key])
    assert _max_diff(trainer.workers.actor.module.state_dict(), sync.workers.actor.module.state_dict()) < 1e-6



@pytest.mark.slow  # an async run and a colocated run (~40 s on 2 busy cores)
def test_with_per_batch_seeds_staleness_zero_is_the_colocated_run(tmp_path, ray_cluster):
    """No replay: with ``rollout.seed_per_batch`` the rollout worker draws the colocated run's random numbers,
    so at staleness 0 (old log-probs recomputed, as the colocated run does) the two runs are the same run:
    the same responses, losses and final weights. Without the seeds they sample differently."""
    from posttrain.trainer.async_trainer import AsyncRLTrainer
    from posttrain.trainer.trainer import RLTrainer

    seeded = ["actor_rollout_ref.rollout.seed_per_batch=True"]
    recompute = ["async_training.compute_prox_log_prob=True", "async_training.use_rollout_log_probs=False"]
    trainer = AsyncRLTrainer(tiny_config(tmp_path, ASYNC + SYNC0 + seeded + recompute + _runs_dirs(tmp_path, "async")))
    trainer.reward_fn = digit_count_reward
    trainer.samples_used = []
    history = trainer.fit()

    def colocated(extra, name):
        run = RLTrainer(tiny_config(tmp_path, ASYNC[2:] + extra + _runs_dirs(tmp_path, name)))
        run.reward_fn = digit_count_reward
        samples, generate = [], run.workers.generate_sequences
        run.workers.generate_sequences = lambda prompts, validate=False: samples.append(generate(prompts)) or samples[-1]
        return run, run.fit(), samples

    sync, reference, samples = colocated(seeded, "sync")
    for got, want in zip(trainer.samples_used, samples):
        assert torch.equal(got["responses"], want["responses"])
    for got, want in zip(history, reference):
        for key in COMPARED:
            assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=1e-6), (got["step"], key, got[key], want[key])
    assert _max_diff(trainer.workers.actor.module.state_dict(), sync.workers.actor.module.state_dict()) < 1e-6

    _, _, unseeded = colocated([], "unseeded")  # negative control: the process's own stream
    assert not torch.equal(unseeded[0]["responses"], samples[0]["responses"])


def _short_turns_model(tmp_path):
    """The tiny Llama, made to end a turn after ~7 tokens (P(eos) ~ 0.14 a token), so that a 160-token
    response holds several turns."""
    from helpers.tiny_models import eos_biased_tiny_llama

    return eos_biased_tiny_llama(tmp_path / "short_turns_model", eos_weight=3.0 / 8)
