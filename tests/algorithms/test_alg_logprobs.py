"""Token log-probs and entropies: direct forms against float64, chunked forms against direct ones."""

import pytest
import torch

from posttrain.algorithms import (
    entropy_from_logits,
    entropy_from_logits_chunked,
    logprobs_and_entropy,
    logprobs_from_logits,
    logprobs_from_logits_chunked,
)


def _inputs(seed=0, shape=(3, 5), vocab=37, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g) * 4).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=g)
    return logits, labels


def _reference(logits, labels):
    x = logits.double()
    logp = torch.log_softmax(x, -1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_direct_forms_match_float64():
    logits, labels = _inputs()
    ref_logp, ref_ent = _reference(logits, labels)
    torch.testing.assert_close(logprobs_from_logits(logits, labels).double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy_from_logits(logits).double(), ref_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
def test_chunked_equals_direct(chunk):
    logits, labels = _inputs(1)
    logp, ent = logprobs_and_entropy(logits, labels, chunk_size=chunk)
    torch.testing.assert_close(logp, logprobs_from_logits(logits, labels), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, entropy_from_logits(logits), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logprobs_from_logits_chunked(logits, labels, chunk), logp, rtol=0, atol=0)
    torch.testing.assert_close(entropy_from_logits_chunked(logits, chunk), ent, rtol=0, atol=0)


@pytest.mark.parametrize("use", ["logp", "entropy", "both"])
def test_chunked_gradients_match_autograd_of_direct(use):
    logits, labels = _inputs(2)
    g = torch.Generator().manual_seed(3)
    w_logp, w_ent = torch.randn(labels.shape, generator=g), torch.randn(labels.shape, generator=g)

    def objective(logp, ent):
        total = 0.0
        if use in ("logp", "both"):
            total = total + (logp * w_logp).sum()
        if use in ("entropy", "both"):
            total = total + (ent * w_ent).sum()
        return total

    x64 = logits.double().requires_grad_(True)
    (ref_grad,) = torch.autograd.grad(objective(*_reference(x64, labels)), x64)
    x = logits.clone().requires_grad_(True)
    logp, ent = logprobs_and_entropy(x, labels if use != "entropy" else None, chunk_size=4, with_entropy=use != "logp")
    (grad,) = torch.autograd.grad(objective(logp, ent), x)
    assert grad.dtype == torch.float32
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-5)


def test_chunked_bf16_upcasts_each_chunk_and_returns_float32():
    logits, labels = _inputs(4, dtype=torch.bfloat16)
    ref_logp, ref_ent = _reference(logits, labels)  # exact maths on the bf16 values
    x = logits.clone().requires_grad_(True)
    logp, ent = logprobs_and_entropy(x, labels, chunk_size=3)
    assert logp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad(logp.sum() + ent.sum(), x)
    assert grad.dtype == torch.bfloat16 and grad.shape == x.shape


def test_chunk_size_must_be_positive():
    logits, labels = _inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        logprobs_and_entropy(logits, labels, chunk_size=0)
