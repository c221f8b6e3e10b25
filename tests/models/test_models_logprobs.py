"""Response log-probs/entropy: padding trimming, valid-token-only lm_head, chunking, gradients."""

from __future__ import annotations

import contextlib

import pytest
import torch

from helpers.saved import kept_for_backward
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.models import (
    autocast_context,
    compute_response_logprobs,
    enable_activation_checkpointing,
    measure_matmul_flops,
    response_logprobs,
)
from posttrain.models.lean import head as head_mod
from posttrain.models.lean.backward import RecastLinear, keep_less_for_backward
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
    monkeypatch.setattr(head_mod, "CHUNK_ELEMENTS", 3 * len(tok))  # 3 tokens per lm_head chunk
    model = tiny_llama(tok).eval()
    lp, ent = compute_response_logprobs(model, data, micro, 0.7, True, use_dynamic_bsz=dynamic, max_token_len=24,
                                        remove_padding=packed)
    with torch.no_grad():
        want_lp, want_ent = naive(model, data, 0.7)
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("micro,dynamic,packed", [(4, False, False), (1, False, False), (None, True, False),
                                                  (3, False, True)])
def test_sum_pi_squared_from_the_same_pass(tok, data, monkeypatch, micro, dynamic, packed):
    """``calculate_sum_pi_squared`` (the old-log-prob pass for optimal_token_baseline): a third tensor, each
    valid token's sum over the vocabulary of softmax(logits / T)^2, 0 elsewhere; log-probs and entropy unchanged."""
    monkeypatch.setattr(head_mod, "CHUNK_ELEMENTS", 3 * len(tok))
    model = tiny_llama(tok).eval()
    lp, ent, sum_pi2 = compute_response_logprobs(model, data, micro, 0.7, True, use_dynamic_bsz=dynamic,
                                                 max_token_len=24, remove_padding=packed,
                                                 calculate_sum_pi_squared=True)
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"],
                       position_ids=data["position_ids"]).logits[:, -R - 1:-1].double() / 0.7
    mask = data["attention_mask"][:, -R:]
    want = torch.softmax(logits, -1).square().sum(-1) * mask
    torch.testing.assert_close(sum_pi2.double(), want, rtol=1e-5, atol=1e-7)
    want_lp, want_ent = compute_response_logprobs(model, data, micro, 0.7, True, use_dynamic_bsz=dynamic,
                                                  max_token_len=24, remove_padding=packed)
    assert torch.equal(lp, want_lp) and torch.equal(ent, want_ent)
    _, no_ent, sum_pi2_alone = compute_response_logprobs(model, data, micro, 0.7, False, calculate_sum_pi_squared=True,
                                                         use_dynamic_bsz=dynamic, max_token_len=24,
                                                         remove_padding=packed)
    assert no_ent is None and torch.allclose(sum_pi2_alone, sum_pi2, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="without gradient"):
        response_logprobs(model, **data, calculate_sum_pi_squared=True)


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
    monkeypatch.setattr(head_mod, "CHUNK_ELEMENTS", chunk_rows * len(tok))
    monkeypatch.setattr(head_mod, "KEEP_ELEMENTS", keep_rows * len(tok))
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
    _, _, sum_pi2 = compute_response_logprobs(Opaque(), data, 2, calculate_sum_pi_squared=True)
    torch.testing.assert_close(sum_pi2, compute_response_logprobs(model, data, 2, calculate_sum_pi_squared=True)[2],
                               rtol=1e-5, atol=1e-6)


def test_measure_matmul_flops_is_positive():
    assert measure_matmul_flops("fp32", (64, 64, 64), min_time_s=0.01) > 1e6
    assert measure_matmul_flops("bf16", (64, 64, 64), min_time_s=0.01) > 1e6


# --- the lm_head + log-prob step as one autograd node (`_LinearHeadLogProbs`) against today's chunked path ---

def _head_case(vocab=1000, hidden_size=64, rows=70, seed=0, head_cls=RecastLinear):
    """hidden ``[rows, H]`` (a float32 leaf, as the final norm hands it out), a bias-free head, labels ``[rows]``."""
    g = torch.Generator().manual_seed(seed)
    head = head_cls(hidden_size, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden_size, generator=g) * 0.3)
    hidden = torch.randn(rows, hidden_size, generator=g).requires_grad_(True)
    return hidden, head, torch.randint(0, vocab, (rows,), generator=g)


@contextlib.contextmanager
def _todays_path(today: bool):
    """With ``today``, every head takes the chunked path, as all did before the one node (non-plain heads still do)."""
    plain = head_mod.is_plain_linear_head
    head_mod.is_plain_linear_head = (lambda *_: False) if today else plain
    try:
        yield
    finally:
        head_mod.is_plain_linear_head = plain


def _stats(hidden, head, labels, temperature=0.7, entropy=True, entropy_grad=True, bf16=True, today=False):
    """(log-prob, entropy) from step 4 as the grad-enabled update runs it (``today``: `_todays_path`)."""
    with _todays_path(today), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return head_mod.head_logprobs(hidden, labels, head, temperature, None, entropy, entropy_grad)


def _objective(logp, ent, with_entropy=True):
    """A weighted sum of log-probs and (when ``with_entropy``) entropies, as a policy loss with an entropy bonus."""
    g = torch.Generator().manual_seed(7)
    loss = (logp * torch.randn(logp.shape, generator=g).to(logp.dtype)).sum()
    return loss + (ent * torch.randn(ent.shape, generator=g).to(ent.dtype)).sum() if with_entropy else loss


def _float64_grads(objective, hidden, head, labels, temperature=0.7):
    """Plain autograd in float64 on the same float32 values: gradients of hidden and weight."""
    h64 = hidden.detach().double().requires_grad_(True)
    w64 = head.weight.detach().double().requires_grad_(True)
    logp_all = torch.log_softmax(h64 @ w64.t() / temperature, -1)
    objective(logp_all.gather(-1, labels[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)).backward()
    return h64.grad, w64.grad


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.fixture
def small_chunks(monkeypatch):
    """16 rows per chunk, 256 vocabulary columns per backward slice (the last one partial for a 1000 vocabulary)."""
    monkeypatch.setattr(head_mod, "CHUNK_ELEMENTS", 16 * 1000)
    monkeypatch.setattr(head_mod, "VOCAB_SLICE", 256)


@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy", [True, False])
@pytest.mark.parametrize("head_cls", [RecastLinear, torch.nn.Linear])
def test_one_node_forward_is_todays_bits(small_chunks, bf16, temperature, entropy, head_cls):
    hidden, head, labels = _head_case(head_cls=head_cls)
    logp, ent = _stats(hidden, head, labels, temperature, entropy, bf16=bf16)
    want_logp, want_ent = _stats(hidden, head, labels, temperature, entropy, bf16=bf16, today=True)
    assert logp.requires_grad and logp.grad_fn is not None and "LinearHeadLogProbs" in type(logp.grad_fn).__name__
    assert torch.equal(logp, want_logp) and torch.equal(ent, want_ent)  # bitwise
    assert ent.requires_grad == entropy and ent.numel() == (labels.numel() if entropy else 0)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("entropy,entropy_grad", [(True, True), (True, False), (False, True)])
def test_one_node_gradients_match_float64(small_chunks, monkeypatch, bf16, keep, entropy, entropy_grad):
    """Gradients of hidden and weight, from kept bf16/float32 logits or recomputed ones, against float64
    autograd: float32 to float32 rounding; bf16 no further from float64 than today's path (which rounds the
    same logits, the logit gradient and the weight gradient to bf16 as well)."""
    monkeypatch.setattr(head_mod, "KEEP_ELEMENTS", (1 << 30) if keep else 0)
    hidden, head, labels = _head_case()
    errors = {}
    for today in (False, True):
        hidden.grad = head.weight.grad = None
        with_entropy = entropy and entropy_grad
        logp, ent = _stats(hidden, head, labels, 0.7, entropy, entropy_grad, bf16=bf16, today=today)
        _objective(logp, ent, with_entropy).backward()
        want_h, want_w = _float64_grads(lambda lp, e: _objective(lp, e, with_entropy), hidden, head, labels)
        assert hidden.grad.dtype == head.weight.grad.dtype == torch.float32
        errors[today] = _relative_error(hidden.grad, want_h), _relative_error(head.weight.grad, want_w)
    if bf16:  # bf16 logits and products: ~0.4% per rounding
        assert max(errors[False]) < 0.02
        assert errors[False][0] < 1.2 * errors[True][0] and errors[False][1] < 1.2 * errors[True][1]
    else:
        assert max(errors[False]) < 1e-5


def test_one_node_handles_only_an_entropy_loss_and_an_empty_micro_batch(small_chunks):
    hidden, head, labels = _head_case()
    _, ent = _stats(hidden, head, labels, bf16=False)
    ent.sum().backward()  # the log-prob's gradient arrives as None
    want_h, want_w = _float64_grads(lambda lp, e: e.sum(), hidden, head, labels)
    assert _relative_error(hidden.grad, want_h) < 1e-5 and _relative_error(head.weight.grad, want_w) < 1e-5
    logp, ent = _stats(hidden[:0], head, labels[:0], bf16=True)
    assert logp.shape == ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()


def _kept_bytes(fn):
    """``fn()``'s outputs, and the bytes autograd keeps for backward while it runs forward: each storage once;
    parameters (in memory anyway) count 0."""
    with kept_for_backward() as kept:
        out = fn()
    return [t.detach() for t in out], kept.bytes


@pytest.mark.parametrize("entropy,share", [(False, 1 / 2), (True, 1 / 4)])
def test_one_node_keeps_bf16_logits_not_float32_softmax(entropy, share):
    """SmolLM2's head (V=49152, H=576), 600 scored tokens (2 chunks of 341 rows), bf16 autocast: today's path
    keeps each chunk's float32 softmax (and with an entropy gradient its float32 log-softmax too); the one
    node keeps the bf16 logits, half (a quarter) of that. Today's path is the negative control: it fails
    the same bound."""
    rows, vocab, width = 600, 49152, 576
    hidden, head, labels = _head_case(vocab, width, rows)
    out, kept = _kept_bytes(lambda: _stats(hidden, head, labels, 1.0, entropy))
    out_today, kept_today = _kept_bytes(lambda: _stats(hidden, head, labels, 1.0, entropy, today=True))
    assert all(torch.equal(a, b) for a, b in zip(out, out_today))  # the same bits at this size too
    # per row: bf16 logits and hidden state, the label (8 B), logsumexp (4 B) and the entropy (4 B) if any
    assert kept == rows * ((vocab + width) * 2 + 8 + 4 + (4 if entropy else 0))
    assert kept == pytest.approx(share * kept_today, rel=0.01)  # today's: float32 [t, V] tensors and bf16 hidden
    assert not kept_today <= 1.01 * rows * (vocab + width) * 2


@pytest.mark.parametrize("bf16", [False, True])
def test_tied_head_gets_the_same_gradient_as_todays_path(tok, data, monkeypatch, bf16):
    """The head's weight is the input embedding: autograd sums the node's weight gradient with the embedding's.
    4 rows per chunk, vocabulary slices of 32 columns (the last one partial)."""
    monkeypatch.setattr(head_mod, "CHUNK_ELEMENTS", 4 * len(tok))
    monkeypatch.setattr(head_mod, "VOCAB_SLICE", 32)
    calls, one_node = [], head_mod._LinearHeadLogProbs.apply
    monkeypatch.setattr(head_mod._LinearHeadLogProbs, "apply", lambda *args: calls.append(1) or one_node(*args))
    grads = {}
    for today in (False, True):
        model = tiny_llama(tok, tie_word_embeddings=True).train()
        keep_less_for_backward(model)
        assert model.lm_head.weight is model.model.embed_tokens.weight and type(model.lm_head) is RecastLinear
        with _todays_path(today), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            lp, ent = response_logprobs(model, **data, temperature=0.9, calculate_entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        grads[today] = {n: p.grad for n, p in model.named_parameters()}
        assert len(calls) == 1  # the one node's micro-batch only
    tied = "model.embed_tokens.weight"
    for name, want in grads[True].items():  # bf16: the same products, rounded to bf16 per slice instead of per chunk
        assert _relative_error(grads[False][name], want.double()) < (1e-2 if bf16 else 1e-6), name
    assert grads[False][tied].abs().sum() > 0


def test_frozen_head_gets_no_gradient_and_hidden_the_right_one(small_chunks):
    """A frozen head (LoRA's, with adapters elsewhere): no weight gradient built, hidden's as float64's."""
    hidden, head, labels = _head_case()
    head.weight.requires_grad_(False)
    _objective(*_stats(hidden, head, labels, bf16=False)).backward()
    want_h, _ = _float64_grads(_objective, hidden, head, labels)
    assert head.weight.grad is None and _relative_error(hidden.grad, want_h) < 1e-5


def test_heads_that_are_more_than_a_product_keep_todays_path():
    """A LoRA wrapper (peft's, on the head), a bias, a softcap, or hooks (an FSDP unit gathers its weight in
    them): the chunked path, through the head's own forward."""
    import peft

    hidden, head, labels = _head_case()
    plain = head_mod.is_plain_linear_head
    assert plain(head, None) and plain(torch.nn.Linear(4, 4, bias=False), None)
    assert not plain(head, 30.0) and not plain(torch.nn.Linear(4, 4), None)
    holder = torch.nn.Sequential()
    holder.add_module("lm_head", head)
    lora_head = peft.get_peft_model(holder, peft.LoraConfig(r=2, target_modules=["lm_head"])).base_model.model.lm_head
    assert not plain(lora_head, None)
    head.register_forward_pre_hook(lambda *_: None)
    assert not plain(head, None)
    logp, _ = _stats(hidden, head, labels)
    assert "LinearHeadLogProbs" not in type(logp.grad_fn).__name__
