"""Token log-probs and entropies: verl's direct forms and `logprob_and_entropy` (the math training
uses) against float64, their gradients against float64 autograd, and the training path calling it."""

import pytest
import torch

from posttrain.algorithms import entropy_from_logits, logprob_and_entropy, logprobs_from_logits
from posttrain.algorithms.logprobs import logprob_entropy_sum_pi_squared


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


@pytest.mark.parametrize("use", ["logp", "entropy", "both"])
def test_logprob_and_entropy_values_and_gradients_match_float64(use):
    logits, labels = _inputs(2)
    rows, vocab = labels.numel(), logits.shape[-1]
    g = torch.Generator().manual_seed(3)
    w_logp, w_ent = torch.randn(rows, generator=g), torch.randn(rows, generator=g)

    def objective(logp, ent):
        total = 0.0
        if use in ("logp", "both"):
            total = total + (logp * w_logp).sum()
        if use in ("entropy", "both"):
            total = total + (ent * w_ent).sum()
        return total

    x64 = logits.reshape(rows, vocab).double().requires_grad_(True)
    ref_logp, ref_ent = _reference(x64, labels.reshape(rows))
    (ref_grad,) = torch.autograd.grad(objective(ref_logp, ref_ent), x64)
    x = logits.reshape(rows, vocab).clone().requires_grad_(True)
    logp, ent = logprob_and_entropy(x, labels.reshape(rows), calculate_entropy=use != "logp")
    torch.testing.assert_close(logp.double(), ref_logp.detach(), rtol=1e-5, atol=1e-5)
    if use != "logp":
        torch.testing.assert_close(ent.double(), ref_ent.detach(), rtol=1e-5, atol=1e-5)
    else:
        assert ent.numel() == 0
    (grad,) = torch.autograd.grad(objective(logp, ent), x)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-5)


def test_entropy_without_grad_is_a_metric_only():
    logits, labels = _inputs(4)
    x = logits.reshape(-1, logits.shape[-1]).requires_grad_(True)
    logp, ent = logprob_and_entropy(x, labels.reshape(-1), entropy_grad=False)
    assert logp.requires_grad and not ent.requires_grad
    x64 = x.detach().double().requires_grad_(True)  # the log-prob's gradient is the float64 one, with no entropy term
    (ref_grad,) = torch.autograd.grad(_reference(x64, labels.reshape(-1))[0].sum(), x64)
    (grad,) = torch.autograd.grad(logp.sum(), x)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-5)


def test_the_training_path_computes_log_probs_with_it(monkeypatch):
    """`models.logprobs` (model + batch -> response log-probs) calls `algorithms.logprobs`: one copy."""
    from helpers.tiny_models import tiny_llama, tiny_prompt_batch
    from helpers.tokenizer import build_tiny_tokenizer
    from posttrain.models import logprobs as model_logprobs
    from posttrain.models.lean import head  # the LM head's step of it (chunks, lean backward)

    calls = []
    real = head.logprob_and_entropy
    monkeypatch.setattr(head, "logprob_and_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    tok = build_tiny_tokenizer()
    model = tiny_llama(tok)
    prompts = tiny_prompt_batch(tok, ["1+1=", "2+2="])
    responses = torch.tensor([[5, 6, 7], [8, 9, 10]])
    ids = torch.cat([prompts["input_ids"], responses], 1)
    mask = torch.cat([prompts["attention_mask"], torch.ones_like(responses)], 1)
    pos = torch.clamp(mask.cumsum(-1) - 1, min=0)
    logp, ent = model_logprobs.response_logprobs(model, ids, mask, pos, responses, calculate_entropy=True)
    assert calls and logp.shape == responses.shape
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -4:-1].float()
    torch.testing.assert_close(logp, logprobs_from_logits(logits, responses), rtol=1e-4, atol=1e-4)


def test_float32_under_bf16_autocast():
    """Training calls it inside bf16 autocast: float32 logits stay float32 (log-prob and entropy)."""
    logits, labels = _inputs(5)
    x = logits.reshape(-1, logits.shape[-1]).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent = logprob_and_entropy(x, labels.reshape(-1))
    assert logp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(ent, entropy_from_logits(x.detach()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("entropy", [True, False])
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_sum_pi_squared_matches_float64(entropy, scale):
    logits, labels = _inputs(5, shape=(7,), vocab=301)
    logits = logits * scale  # 30: peaked rows, sum pi^2 near 1
    ref_logp, ref_ent = _reference(logits, labels)
    ref = torch.softmax(logits.double(), -1).square().sum(-1)
    logp, ent, sum_pi2 = logprob_entropy_sum_pi_squared(logits, labels, entropy)
    torch.testing.assert_close(sum_pi2.double(), ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    assert ent.numel() == 0 if not entropy else torch.allclose(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    assert not logp.requires_grad
    # hand case: a uniform row over V words has sum pi^2 = V * (1/V)^2 = 1/V; one certain word: 1
    flat, sure = torch.zeros(1, 4), torch.tensor([[0.0, -1e4, -1e4, -1e4]])
    assert logprob_entropy_sum_pi_squared(flat, torch.tensor([0]))[2].item() == pytest.approx(0.25)
    assert logprob_entropy_sum_pi_squared(sure, torch.tensor([0]))[2].item() == pytest.approx(1.0)
    # negative control: sum pi (not squared) is 1 everywhere, far from it
    assert not torch.allclose(sum_pi2.double(), torch.ones_like(ref), atol=1e-3)

