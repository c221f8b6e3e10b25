"""Trainer-rollout parity: the HF engine's ``rollout_log_probs`` equal the actor's recomputed
``compute_log_prob`` for the same tokens (STYLE.md rule 13).

Tolerance: fp32 on CPU, 2e-5 absolute on log-probs of magnitude ~5. The two paths differ only in
KV-cached incremental decoding vs one full forward (different matmul shapes/summation order).
bf16 autocast is checked loosely (bf16 has ~3 significant digits).
"""

from __future__ import annotations

import pytest
import torch

from helpers.tokenizer import build_tiny_tokenizer
from posttrain.workers import ActorWorker
from helpers.tiny_models import tiny_llama, tiny_prompt_batch, tiny_worker_configs

PROMPTS = ["1+1=", "hello there, 2*3=", "x", "what is 17-5?", "ab"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def rollout_and_recompute(tok, param_dtype: str, temperature: float, **rollout_kw):
    cfg = tiny_worker_configs(response_length=12, micro_batch_size=3, param_dtype=param_dtype,
                              temperature=temperature, n=3)
    for key, value in rollout_kw.items():
        setattr(cfg.rollout, key, value)
    actor = ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=tiny_llama(tok), tokenizer=tok)
    torch.manual_seed(0)
    out = actor.generate_sequences(tiny_prompt_batch(tok, PROMPTS))
    old_log_probs, _ = actor.compute_log_prob(out)
    return out, old_log_probs


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fp32_parity(tok, temperature):
    out, old = rollout_and_recompute(tok, "fp32", temperature)
    mask = out["response_mask"].bool()
    assert out["rollout_log_probs"].shape == old.shape == (15, 12)
    torch.testing.assert_close(out["rollout_log_probs"][mask], old[mask], rtol=0, atol=2e-5)
    assert torch.all(out["rollout_log_probs"][~mask] == 0) and torch.all(old[~mask] == 0)


def test_fp32_parity_with_top_k_top_p(tok):
    """Truncated sampling still reports untruncated log-probs at temperature (what the actor computes)."""
    out, old = rollout_and_recompute(tok, "fp32", 0.9, top_k=20, top_p=0.8)
    mask = out["response_mask"].bool()
    torch.testing.assert_close(out["rollout_log_probs"][mask], old[mask], rtol=0, atol=2e-5)


def test_bf16_autocast_parity_is_close(tok):
    out, old = rollout_and_recompute(tok, "bf16", 1.0)
    mask = out["response_mask"].bool()
    diff = (out["rollout_log_probs"] - old)[mask].abs()
    assert diff.max() < 0.1 and diff.mean() < 0.02
