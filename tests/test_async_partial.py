"""Partial rollouts end to end (issue 39; marker ``slow``): one rollout worker on the hf engine, staleness 1,
``async_training.partial_rollout=True``. Responses are long (the model starts without EOS), so the trainer's
push after each update lands while the worker is decoding the next batch. The worker takes it between two
decoding steps: in such a unit every token's rollout log-prob is the one of the weights that sampled it,
the version the unit started with up to one decoding step, the pushed version after it (checked against
the trainer's own weights of both versions, which differ there)."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from helpers.tiny_run import digit_count_reward, tiny_config  # noqa: E402

pytestmark = pytest.mark.slow
R = 256


def _endless_model(tmp_path):
    """The tiny Llama with EOS held far below every other token (logit ~ -30): responses never end."""
    from helpers.tiny_models import eos_biased_tiny_llama

    return eos_biased_tiny_llama(tmp_path / "endless_model", eos_weight=-4.0)


LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8", "actor_rollout_ref.actor.optim.lr=5e-2"]


@pytest.mark.parametrize("weights", ["full", "lora"])
def test_a_push_mid_generation_takes_over_the_rest_of_the_responses(tmp_path, weights):
    """LoRA: the worker decodes with the adapters merged into the weights; a push refreshes that merge."""
    from posttrain.trainer.async_trainer import AsyncRLTrainer

    overrides = [f"actor_rollout_ref.model.path={_endless_model(tmp_path)}", f"data.max_response_length={R}",
                 "actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.rollout.n_gpus_per_node=1",
                 "async_training.staleness_threshold=1", "async_training.partial_rollout=True",
                 "actor_rollout_ref.actor.optim.lr=1e-2", "trainer.total_training_steps=3"]
    overrides += LORA if weights == "lora" else []
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    trainer = None
    try:
        trainer = AsyncRLTrainer(tiny_config(tmp_path, overrides))
        assert trainer.lora_only == (weights == "lora")
        trainer.reward_fn = digit_count_reward
        trainer.samples_used = []
        actor = trainer.workers.actor
        states = [{k: v.clone() for k, v in actor.module.state_dict().items()}]  # version v = states[v]
        versions, push, take = [], trainer._push, trainer._take_fresh

        def push_and_keep():
            states.append({k: v.clone() for k, v in actor.module.state_dict().items()})
            return push()

        def take_and_note(seq):
            batch = take(seq)
            versions.append((batch.meta_info["weight_version"], batch.meta_info["weight_version_end"]))
            return batch

        trainer._push, trainer._take_fresh = push_and_keep, take_and_note
        history = trainer.fit()
        final = {k: v.clone() for k, v in actor.module.state_dict().items()}
        assert len(versions) == len(trainer.samples_used) == 3  # one unit per step (gen_batch_size = batch)
        partial = [i for i, (first, last) in enumerate(versions) if last > first]
        assert partial, versions  # the pushes landed mid-generation
        assert sum(row["fully_async/count/partial_rollout_samples"] for row in history) == 8 * len(partial)

        def log_probs(state, batch):
            actor.module.load_state_dict(state)
            return actor.compute_log_prob(batch, calculate_entropy=False)[0]

        for i in partial:
            batch, (first, last) = trainer.samples_used[i], versions[i]
            assert last == first + 1
            rollout, mask = batch["rollout_log_probs"], batch["response_mask"].bool()
            before, after = log_probs(states[first], batch), log_probs(states[last], batch)
            off = (((rollout - before).abs() > 1e-4) & mask).any(0).nonzero()
            assert off.numel(), "no token came from the pushed weights"
            switch = int(off[0])  # one decoding step for the whole batch
            assert 0 < switch < R  # tokens from both versions
            assert (rollout - before)[:, :switch][mask[:, :switch]].abs().max() < 1e-4
            assert (rollout - after)[:, switch:][mask[:, switch:]].abs().max() < 1e-4
            assert (after - before)[:, switch:][mask[:, switch:]].abs().max() > 1e-3  # the versions differ there
        actor.module.load_state_dict(final)
    finally:
        if trainer is not None:
            trainer.close()
        ray.shutdown()
