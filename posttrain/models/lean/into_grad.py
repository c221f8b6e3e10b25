"""Weight gradients summed straight into ``weight.grad`` during backward, instead of handed to autograd.

Through autograd, a node's gradient for a weight is a tensor of its own, which the weight's
``AccumulateGrad`` then adds to ``weight.grad``. For the two vocabulary-sized weights of a causal LM
that tensor is 113 MB (SmolLM2's 49152 x 576 in float32), made on every micro-batch of an update:

- the LM head's (`posttrain.models.lean.head._LinearHeadLogProbs`), which autograd holds from the head's
  backward to the end of backward when the head is tied to the input embedding (it waits for the
  embedding's gradient, to add the two);
- the input embedding's, a zero-filled ``[V, H]`` tensor into which the few rows the micro-batch's
  tokens touch are summed (`IntoGradEmbedding` sums those rows alone and adds them into ``.grad``).

Inside `grads_into_params` (the update engine's micro-step, `posttrain.workers.actor`) both add into
``weight.grad`` themselves, made if None: the same ``.grad`` autograd would leave (the head's: its terms
added in another order; the embedding's: the same bits, `tests/models/test_into_grad.py`), without the
second weight-sized tensor. Only for a plain leaf weight (no hooks, no DTensor, no process group: FSDP
and DDP read gradients through their own hooks), in a backward that accumulates into it (not
``torch.autograd.grad``, not ``inputs=`` without it, not ``create_graph``); otherwise the gradient goes
through autograd as before.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["IntoGradEmbedding", "adds_into_grad", "embeddings_add_into_grad", "grad_accumulator",
           "grads_into_params"]

_switch = {"on": False}  # grads_into_params' switch: read when the graph is built


@contextlib.contextmanager
def grads_into_params() -> Iterator[None]:
    """Within the block, graphs built through the LM head's log-probs and an `IntoGradEmbedding` add those
    weights' gradients into ``weight.grad`` during backward (module docstring). For a training loop that
    calls ``loss.backward()`` on the graph it builds here."""
    previous = _switch["on"]
    _switch["on"] = True
    try:
        yield
    finally:
        _switch["on"] = previous


def grad_accumulator(weight: torch.Tensor) -> Any:
    """Before the forward, with grad on: the autograd node that would add ``weight``'s gradient to
    ``weight.grad``, where the node being built may do that itself (`grads_into_params`); else None."""
    if not (_switch["on"] and torch.is_grad_enabled() and weight.is_leaf and weight.requires_grad
            and type(weight.data) is torch.Tensor and not weight._backward_hooks
            and getattr(weight, "_post_accumulate_grad_hooks", None) is None
            and not (dist.is_available() and dist.is_initialized())):
        return None
    return weight.view_as(weight).grad_fn.next_functions[0][0]  # the leaf's AccumulateGrad


def adds_into_grad(weight: torch.Tensor, accumulator: Any) -> bool:
    """At backward: whether this backward will run ``weight``'s AccumulateGrad (so adding into ``.grad`` is
    what autograd would do) and ``.grad`` is a plain tensor to add into."""
    will_run = getattr(torch._C, "_will_engine_execute_node", None)
    if accumulator is None or will_run is None or torch.is_grad_enabled():
        return False
    try:
        if not will_run(accumulator):
            return False
    except RuntimeError:  # torch.autograd.grad: nothing accumulates (it refuses to answer for a leaf's node)
        return False
    grad = weight.grad
    return grad is None or (grad.shape == weight.shape and grad.dtype == weight.dtype and grad.is_contiguous()
                            and not grad.is_sparse and not grad.requires_grad)


class _EmbeddingIntoGrad(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose backward adds into ``weight.grad`` the summed gradient of
    each row the ids touched (in the ids' order, as autograd's dense backward sums them), or, where it may not
    (`adds_into_grad`), returns autograd's dense gradient."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None, accumulator: Any):
        ctx.save_for_backward(ids, weight)
        ctx.padding_idx, ctx.accumulator = padding_idx, accumulator
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        ids, weight = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None, None, None
        padding_idx = -1 if ctx.padding_idx is None else ctx.padding_idx
        if not adds_into_grad(weight, ctx.accumulator):
            dense = torch.ops.aten.embedding_dense_backward(grad_out, ids, weight.shape[0], padding_idx, False)
            return None, dense, None, None
        rows, grads = ids.reshape(-1), grad_out.reshape(-1, weight.shape[1])
        if ctx.padding_idx is not None:  # the padding row gets no gradient (nn.Embedding's padding_idx)
            used = rows != padding_idx
            rows, grads = rows[used], grads[used]
        touched, slot = torch.unique(rows, return_inverse=True)
        sums = grads.new_zeros((touched.numel(), weight.shape[1]), dtype=weight.dtype)
        sums.index_add_(0, slot, grads.to(weight.dtype))
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, touched, sums)
        return None, None, None, None


class IntoGradEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose lookup, inside `grads_into_params`, adds its gradient into ``weight.grad``
    (`_EmbeddingIntoGrad`); elsewhere, or with ``max_norm``/``scale_grad_by_freq``/``sparse``, nn.Embedding's."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        plain = self.max_norm is None and not self.scale_grad_by_freq and not self.sparse
        accumulator = grad_accumulator(self.weight) if plain else None
        if accumulator is None:
            return super().forward(input)
        return _EmbeddingIntoGrad.apply(input, self.weight, self.padding_idx, accumulator)


def embeddings_add_into_grad(module: nn.Module) -> int:
    """Every plain ``nn.Embedding`` inside ``module`` switched in place to `IntoGradEmbedding` (a subclass: the
    parameters, the state dict and ``isinstance`` are unchanged); returns how many were switched."""
    switched = 0
    for layer in module.modules():
        if type(layer) is nn.Embedding:
            layer.__class__ = IntoGradEmbedding
            switched += 1
    return switched
