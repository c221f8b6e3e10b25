"""Response log-probs/entropy: padding trimming, valid-token-only lm_head, chunking, gradients."""

from __future__ import annotations

import pytest
import torch

from helpers.tokenizer import build_tiny_tokenizer
from posttrain.models import (
    autocast_context,
    compute_response_logprobs,
    enable_activation_checkpointing,
    measure_matmul_flops,
    response_logprobs,
)
from posttrain.models import logprobs as logprobs_mod
from helpers.tiny_models import tiny_llama

R = 6


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def data(tok):
    """4 rows: prompts left-padded (lengths 3, 5, 2, 5), responses right-padded (lengths 6, 2, 4, 0+1)."""
    g = torch.Generator().manual_seed(0)
    plen, resp_lens, prompt_lens = 6, [6, 2, 4, 1], [3, 5, 2, 5]
    ids = torch.randint(6, len(tok), (4, plen + R), generator=g)
    mask = torch.zeros(4, plen + R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        mask[i, plen - p:plen + r] = 1
    ids = ids.masked_fill(mask == 0, tok.pad_token_id)
    pos = torch.clamp(mask.cumsum(-1) - 1, min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, plen:]}


def naive(model, d, temperature):
    logits = model(input_ids=d["input_ids"], attention_mask=d["attention_mask"],
                   position_ids=d["position_ids"]).logits[:, -R - 1:-1].float() / temperature
    logp = torch.log_softmax(logits, -1)
    mask = d["attention_mask"][:, -R:]
    lp = logp.gather(-1, d["responses"].unsqueeze(-1)).squeeze(-1) * mask
    ent = -(logp.exp() * logp).sum(-1) * mask
    return lp, ent


@pytest.mark.parametrize("micro,dynamic,packed", [(4, False, False), (1, False, False), (3, False, False),
                                                  (None, True, False), (4, False, True), (3, False, True)])
def test_matches_full_logits_reference(tok, data, monkeypatch, micro, dynamic, packed):
    monkeypatch.setattr(logprobs_mod, "CHUNK_ELEMENTS", 3 * len(tok))  # 3 tokens per lm_head chunk
    model = tiny_llama(tok).eval()
    lp, ent = compute_response_logprobs(model, data, micro, 0.7, True, use_dynamic_bsz=dynamic, max_token_len=24,
                                        remove_padding=packed)
    with torch.no_grad():
        want_lp, want_ent = naive(model, data, 0.7)
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)


def test_lm_head_sees_only_valid_response_tokens(tok, data):
    model = tiny_llama(tok).eval()
    rows = []
    model.lm_head.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[0]))
    compute_response_logprobs(model, data, micro_batch_size=4)
    assert sum(rows) == int(data["attention_mask"][:, -R:].sum()) == 13


@pytest.mark.parametrize("packed,chunk_rows,keep_rows", [(False, 4, 0), (True, 4, 0), (False, 4, 1000),
                                                         (False, 1000, 1000)])
def test_gradients_match_reference_with_checkpointing(tok, data, monkeypatch, packed, chunk_rows, keep_rows):
    """Many lm_head chunks (4 rows each), checkpointed (nothing kept) or each keeping its tensor for
    backward; or one chunk (1000 rows)."""
    monkeypatch.setattr(logprobs_mod, "CHUNK_ELEMENTS", chunk_rows * len(tok))
    monkeypatch.setattr(logprobs_mod, "KEEP_ELEMENTS", keep_rows * len(tok))
    model, ref = tiny_llama(tok).train(), tiny_llama(tok).train()
    enable_activation_checkpointing(model)
    weights = torch.randn(4, R, generator=torch.Generator().manual_seed(1))
    lp, ent = response_logprobs(model, **data, temperature=0.9, calculate_entropy=True, remove_padding=packed)
    ((lp * weights).sum() + 0.1 * ent.sum()).backward()
    want_lp, want_ent = naive(ref, data, 0.9)
    ((want_lp * weights).sum() + 0.1 * want_ent.sum()).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_packing_rejects_nonstandard_positions(tok, data):
    bad = dict(data, position_ids=data["position_ids"] + 1)
    with pytest.raises(ValueError, match="position_ids"):
        response_logprobs(tiny_llama(tok), **bad, remove_padding=True)


def test_entropy_without_grad_and_bad_temperature(tok, data):
    model = tiny_llama(tok)
    lp, ent = response_logprobs(model, **data, calculate_entropy=True, entropy_grad=False)
    assert lp.requires_grad and not ent.requires_grad
    with pytest.raises(ValueError, match="temperature"):
        response_logprobs(model, **data, temperature=0.0)


def test_bf16_autocast_close_to_fp32(tok, data):
    model = tiny_llama(tok).eval()
    lp32, _ = compute_response_logprobs(model, data, 4)
    lp16, _ = compute_response_logprobs(model, data, 4, autocast=lambda: autocast_context("cpu", "bf16"))
    assert lp16.dtype == torch.float32
    assert (lp16 - lp32).abs().max() < 0.05


def test_fallback_for_models_without_separate_head(tok, data):
    model = tiny_llama(tok).eval()

    class Opaque(torch.nn.Module):  # exposes only forward(...).logits
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, **kw):
            return self.inner(**kw)

    lp, _ = compute_response_logprobs(Opaque(), data, 2)
    torch.testing.assert_close(lp, compute_response_logprobs(model, data, 2)[0], rtol=1e-5, atol=1e-5)


def test_measure_matmul_flops_is_positive():
    assert measure_matmul_flops("fp32", (64, 64, 64), min_time_s=0.01) > 1e6
    assert measure_matmul_flops("bf16", (64, 64, 64), min_time_s=0.01) > 1e6
