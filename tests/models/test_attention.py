"""CPU attention (`posttrain.models.attention`): the training path that recomputes its probabilities
in backward gives autograd's own values and gradients, and keeps only q, k and v."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.saved import kept_for_backward
from posttrain.models.attention import _mask_scores_, matmul_attention

BATCH, Q_HEADS, KV_HEADS, Q_LEN, KV_LEN, DIM = 3, 6, 2, 5, 9, 8


def _module() -> nn.Module:
    module = nn.Module()
    module.training = True
    return module


def _autograd_attention(query, key, value, mask, scale):
    """The plain path written with autograd's ops (what `matmul_attention` computed before it kept less)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    q = query.reshape(batch, kv_heads, group * q_len, dim)
    scores = (torch.matmul(q, key.transpose(-1, -2)).float() * scale).view(batch, kv_heads, group, q_len, kv_len)
    probs = torch.softmax(_mask_scores_(scores, mask), dim=-1).to(value.dtype)
    out = torch.matmul(probs.view(batch, kv_heads, group * q_len, kv_len), value)
    return out.view(batch, kv_heads, group, q_len, dim).permute(0, 3, 1, 2, 4).reshape(batch, q_len, q_heads, dim)


def _inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(BATCH, Q_HEADS, Q_LEN, DIM), (BATCH, KV_HEADS, KV_LEN, DIM), (BATCH, KV_HEADS, KV_LEN, DIM)]
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


def _masks():
    causal = torch.ones(Q_LEN, KV_LEN, dtype=torch.bool).tril(KV_LEN - Q_LEN)[None, None]
    padded = causal.expand(BATCH, 1, Q_LEN, KV_LEN).clone()
    padded[1, :, :, :3] = False  # row 1 starts with 3 padding keys
    padded[2, :, 0, :] = False  # a query with nothing to attend to (left padding): uniform, finite
    additive = torch.zeros(BATCH, 1, Q_LEN, KV_LEN).masked_fill(~padded, torch.finfo(torch.float32).min)
    return {"causal (None)": None, "bool": padded, "additive": additive}


def _run(fn, inputs, grad_out):
    out = fn(*inputs)
    out.backward(grad_out)
    grads = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    return out.detach(), grads


@pytest.mark.parametrize("mask_name", list(_masks()))
def test_recomputed_probabilities_give_autograds_values_and_gradients_under_bf16_autocast(mask_name):
    mask = _masks()[mask_name]
    scale = DIM ** -0.5
    inputs = _inputs()
    grad_out = torch.randn(BATCH, Q_LEN, Q_HEADS, DIM, generator=torch.Generator().manual_seed(1)).bfloat16()
    reference_mask = mask if mask is not None else _masks()["bool"][:1].clone().fill_(True).tril(KV_LEN - Q_LEN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, got_grads = _run(lambda q, k, v: matmul_attention(_module(), q, k, v, mask), inputs, grad_out)
        want, want_grads = _run(lambda q, k, v: _autograd_attention(q, k, v, reference_mask, scale), inputs, grad_out)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    for name, g, w in zip("qkv", got_grads, want_grads):
        assert torch.equal(g, w), f"gradient of {name}"  # autograd's own ops, op for op: the same bits


def test_gradients_match_a_float64_reference():
    """fp64 inputs, no autocast: the recomputed backward against autograd on a dense softmax."""
    mask = _masks()["bool"]
    inputs = _inputs(torch.float64, seed=3)
    grad_out = torch.randn(BATCH, Q_LEN, Q_HEADS, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    def dense(q, k, v):
        k = k.repeat_interleave(Q_HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(Q_HEADS // KV_HEADS, dim=1)
        scores = (q @ k.transpose(-1, -2)) * DIM ** -0.5
        scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
        return (torch.softmax(scores, -1) @ v).transpose(1, 2)

    got, got_grads = _run(lambda q, k, v: matmul_attention(_module(), q, k, v, mask), inputs, grad_out)
    want, want_grads = _run(dense, inputs, grad_out)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def _saved_bytes(fn, inputs) -> tuple[int, list[tuple[int, ...]]]:
    """Bytes of the distinct storages autograd keeps for ``fn``'s backward, and the kept shapes."""
    with kept_for_backward() as kept, torch.autocast("cpu", dtype=torch.bfloat16):
        fn(*inputs)
    return kept.bytes, kept.shapes


def test_training_attention_keeps_q_k_v_not_the_probabilities():
    mask = _masks()["bool"]
    inputs = [t.detach().bfloat16().requires_grad_() for t in _inputs()]
    qkv_bytes = sum(t.numel() * t.element_size() for t in inputs)
    scores = BATCH * Q_HEADS * Q_LEN * KV_LEN

    kept, shapes = _saved_bytes(lambda q, k, v: matmul_attention(_module(), q, k, v, mask), inputs)
    assert kept == qkv_bytes + mask.numel()  # the bf16 inputs and the bool mask, nothing score-sized
    assert not any(torch.Size(s).numel() == scores for s in shapes)

    # negative control: autograd's own ops keep float32 and bf16 probabilities, 6 bytes a score more
    plain, plain_shapes = _saved_bytes(lambda q, k, v: _autograd_attention(q, k, v, mask, DIM ** -0.5), inputs)
    assert plain - kept >= 6 * scores
    assert any(torch.Size(s).numel() == scores for s in plain_shapes)


def test_without_gradients_nothing_changes():
    mask = _masks()["bool"]
    inputs = _inputs()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = matmul_attention(_module(), *inputs, mask)
        want = _autograd_attention(*inputs, mask, DIM ** -0.5)
    assert torch.equal(got, want)
