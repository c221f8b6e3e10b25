"""Weight gradients summed into ``.grad`` inside `grads_into_params` (posttrain.models.lean.into_grad): the LM head's
and the input embedding's. Each against autograd's own path (the reference, and the negative control for the
tensors it makes)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.tiny_models import tiny_llama
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.models import response_logprobs
from posttrain.models.lean.into_grad import IntoGradEmbedding, embeddings_add_into_grad, grads_into_params
from posttrain.models.lean.backward import keep_less_for_backward


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def data(tok):
    """3 rows, prompts left-padded with the pad token (the embedding's padding_idx), responses right-padded;
    ids drawn from a few words, so every touched row of the embedding is touched several times."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, 20, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    mask[1, -2:] = 0
    ids = ids.masked_fill(mask == 0, tok.pad_token_id)
    pos = torch.clamp(mask.cumsum(-1) - 1, min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, 6:]}


class _MadeTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Shapes and dtypes of every tensor an op makes inside the block (views and in-place results excluded)."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.made.append((tuple(t.shape), t.dtype))
        return out


def _two_micro_batches(model, data, into_param: bool):
    """Gradients after two micro-batches' forward + backward (bf16 autocast) and, for the second backward,
    how many float32 tensors of the vocabulary weight's shape were made."""
    model.zero_grad(set_to_none=True)
    made = None
    for step in range(2):
        with grads_into_params() if into_param else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                lp, ent = response_logprobs(model, **data, calculate_entropy=True)
            loss = -(lp.sum() + 0.1 * ent.sum()) / (step + 1)
        with _MadeTensors() as made:
            loss.backward()
    weight = model.lm_head.weight
    n_weight_sized = sum(1 for shape, dtype in made.made if shape == tuple(weight.shape) and dtype == torch.float32)
    return {name: p.grad.clone() for name, p in model.named_parameters()}, n_weight_sized


def _lean(tok, tied: bool, embedding: bool):
    model = tiny_llama(tok, tie_word_embeddings=tied)
    keep_less_for_backward(model)
    if embedding:
        assert embeddings_add_into_grad(model) == 1
    return model


def _assert_same_but_the_tied_weights_order(got: dict, want: dict) -> None:
    """Every gradient bitwise ``want``'s but the tied weight's, whose terms were added in another order
    (float32 rounding)."""
    for name, g in want.items():
        if "embed_tokens" in name:
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(got[name], g), name


# --------------------------------------------------------------------------- the LM head
def test_head_leaves_the_same_grads_without_a_second_weight_buffer(tok, data):
    """Two micro-batches with a tied embedding (itself through autograd): the same gradients as through
    autograd (the tied weight's three terms added in another order: float32 rounding), and on the second
    backward, where ``.grad`` exists, one weight-sized float32 tensor fewer is made (autograd's path is the
    negative control: the head's gradient buffer and its sum with the embedding's)."""
    model = _lean(tok, tied=True, embedding=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    grads, made = _two_micro_batches(model, data, into_param=False)
    grads_into, made_into = _two_micro_batches(model, data, into_param=True)
    _assert_same_but_the_tied_weights_order(grads_into, grads)
    assert made_into <= made - 1, (made_into, made)


def test_head_falls_back_where_autograd_must_see_the_gradient(tok, data):
    """A hooked weight (its hook must see the gradient), ``torch.autograd.grad`` (nothing accumulates) and
    ``create_graph`` keep autograd's path."""
    model = _lean(tok, tied=True, embedding=False)
    grads, _ = _two_micro_batches(model, data, into_param=False)
    seen = []
    handle = model.lm_head.weight.register_hook(lambda g: seen.append(g.shape))
    try:
        grads_hooked, _ = _two_micro_batches(model, data, into_param=True)
    finally:
        handle.remove()
    assert len(seen) == 2  # one sum (head + embedding) per backward, as without the switch
    assert all(torch.equal(grads_hooked[n], g) for n, g in grads.items())
    weight = model.lm_head.weight
    weight_grads = []
    for create_graph in (False, True):
        model.zero_grad(set_to_none=True)
        with grads_into_params(), torch.autocast("cpu", dtype=torch.bfloat16):
            lp, _ = response_logprobs(model, **data)
        (weight_grad,) = torch.autograd.grad(-lp.sum(), [weight], create_graph=create_graph)
        assert weight.grad is None
        weight_grads.append(weight_grad.detach())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = response_logprobs(model, **data)
    (want,) = torch.autograd.grad(-lp.sum(), [weight])
    assert all(torch.equal(g, want) for g in weight_grads)  # the head's term and the embedding's, both


# --------------------------------------------------------------------------- the input embedding
def test_embedding_adds_the_same_bits_into_grad_and_makes_no_dense_gradient(tok, data):
    """An untied model: with the embedding's rows summed into ``.grad``, every gradient after two
    micro-batches is bitwise autograd's (the rows summed in the ids' order, as the dense backward sums them;
    the padding row untouched), and the second backward makes no vocabulary-sized float32 tensor, where
    autograd's path (the negative control) makes its zero-filled dense gradient."""
    plain = _lean(tok, tied=False, embedding=False)
    into = _lean(tok, tied=False, embedding=True)
    into.load_state_dict(plain.state_dict())
    grads, made = _two_micro_batches(plain, data, into_param=True)  # the head's into .grad in both
    grads_into, made_into = _two_micro_batches(into, data, into_param=True)
    assert grads.keys() == grads_into.keys()
    for name, g in grads.items():
        assert torch.equal(grads_into[name], g), name
    pad = tok.pad_token_id
    assert bool((data["input_ids"] == pad).any()) and not grads_into["model.embed_tokens.weight"][pad].any()
    assert made >= 1 and made_into == 0, (made, made_into)


def test_tied_weight_gets_both_terms_into_grad_without_a_weight_sized_tensor(tok, data):
    """Tied: the head's term and the embedding's both go into ``.grad``: the same gradients as autograd's path
    (the tied weight's terms in another order: float32 rounding; every other tensor bitwise), and the second
    backward makes no weight-sized float32 tensor at all (autograd's path makes at least two)."""
    plain = _lean(tok, tied=True, embedding=False)
    into = _lean(tok, tied=True, embedding=True)
    into.load_state_dict(plain.state_dict())
    grads, made = _two_micro_batches(plain, data, into_param=False)
    grads_into, made_into = _two_micro_batches(into, data, into_param=True)
    _assert_same_but_the_tied_weights_order(grads_into, grads)
    assert made >= 2 and made_into == 0, (made, made_into)


def _embedding_grads(embedding: nn.Embedding, ids: torch.Tensor, upstream: torch.Tensor, into: bool, **backward):
    embedding.zero_grad(set_to_none=True)
    with grads_into_params() if into else contextlib.nullcontext():
        out = embedding(ids)
    (out * upstream).sum().backward(**backward)
    return embedding.weight.grad


@pytest.mark.parametrize("options", [{}, {"padding_idx": 3}, {"max_norm": 1.0}, {"scale_grad_by_freq": True}])
def test_embedding_matches_autograd_with_and_without_the_switch(options):
    """Repeated ids, with and without a padding row; options whose gradient this does not compute
    (``max_norm``, ``scale_grad_by_freq``) keep nn.Embedding's forward. Without the switch, nn.Embedding's."""
    torch.manual_seed(0)
    reference = nn.Embedding(50, 8, **options)
    embedding = nn.Embedding(50, 8, **options)
    embedding.load_state_dict(reference.state_dict())
    embeddings_add_into_grad(embedding)
    assert isinstance(embedding, IntoGradEmbedding) and isinstance(embedding, nn.Embedding)
    ids = torch.tensor([[3, 7, 7, 1], [3, 3, 9, 7]])
    upstream = torch.randn(2, 4, 8)
    want = _embedding_grads(reference, ids, upstream, into=False)
    for into in (False, True):
        assert torch.equal(_embedding_grads(embedding, ids, upstream, into=into), want), into


def test_embedding_falls_back_where_autograd_must_see_the_gradient():
    """A hooked weight, ``torch.autograd.grad``, ``create_graph`` and ``inputs=`` without the weight: autograd's
    dense gradient, returned to autograd (the weight's ``.grad`` untouched where nothing accumulates)."""
    torch.manual_seed(0)
    embedding = nn.Embedding(50, 8)
    embeddings_add_into_grad(embedding)
    ids, upstream = torch.tensor([[3, 7, 7, 1]]), torch.randn(1, 4, 8)
    want = _embedding_grads(embedding, ids, upstream, into=False)
    seen = []
    handle = embedding.weight.register_hook(lambda g: seen.append(g.clone()))
    try:
        assert torch.equal(_embedding_grads(embedding, ids, upstream, into=True), want)
    finally:
        handle.remove()
    assert len(seen) == 1 and torch.equal(seen[0], want)
    for create_graph in (False, True):
        embedding.zero_grad(set_to_none=True)
        with grads_into_params():
            out = embedding(ids)
        (grad,) = torch.autograd.grad((out * upstream).sum(), [embedding.weight], create_graph=create_graph)
        assert torch.equal(grad.detach(), want) and embedding.weight.grad is None
    other = torch.zeros(1, requires_grad=True)
    embedding.zero_grad(set_to_none=True)
    with grads_into_params():
        out = embedding(ids)
    ((out * upstream).sum() + other.sum()).backward(inputs=[other])
    assert embedding.weight.grad is None and other.grad is not None


def test_only_exact_embeddings_are_switched_and_the_state_dict_is_unchanged(tok):
    """A subclass of nn.Embedding keeps its own forward; the switched model's state dict is the same tensors."""

    class Scaled(nn.Embedding):
        def forward(self, input):
            return F.embedding(input, self.weight) * 2

    model = tiny_llama(tok, tie_word_embeddings=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    holder = nn.ModuleDict({"model": model, "scaled": Scaled(4, 2)})
    assert embeddings_add_into_grad(holder) == 1
    assert type(holder["scaled"]) is Scaled
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
