"""The LM head's log-probs and entropy of ``[T, H]`` hidden states (step 4 of `posttrain.models.logprobs`),
chunk by chunk, with a backward that keeps little.

``head_logprobs(hidden, labels, head, ...)`` -> (log-prob ``[T]``, entropy ``[T]`` or empty[, sum of pi^2]),
float32. With gradients on and a plain bias-free linear head, all chunks are one autograd node
(`_LinearHeadLogProbs`, the same forward bits as the chunked path) that keeps each chunk's logits in the
compute dtype (bf16 under autocast: half of the float32 softmax autograd would keep) and a logsumexp per row,
while the micro-batch's total stays within ``KEEP_ELEMENTS`` logits, else nothing (backward recomputes each
chunk's logits). Its backward walks the vocabulary in slices, so no float32 ``[t, V]`` gradient, no bf16 copy
of the weight and one float32 weight gradient exist: the backward of the actor update's lm_head was the
step's memory peak. Inside `posttrain.models.lean.into_grad.grads_into_params` (the update engine's
micro-step) that gradient is summed into ``weight.grad`` itself. Other heads (a LoRA wrapper, a bias,
Gemma's softcap, an FSDP unit of its own) go through autograd chunk by chunk: each chunk keeps its float32
softmax within ``KEEP_ELEMENTS``, beyond it is checkpointed.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from posttrain.algorithms.logprobs import logit_gradient, logprob_and_entropy, logprob_entropy_sum_pi_squared
from posttrain.models.lean.backward import RecastLinear, low_dtype
from posttrain.models.lean.into_grad import adds_into_grad, grad_accumulator

__all__ = ["CHUNK_ELEMENTS", "KEEP_ELEMENTS", "head_logprobs", "is_plain_linear_head"]

CHUNK_ELEMENTS = 1 << 24  # logits elements per chunk: 16M floats = 64 MiB in float32
KEEP_ELEMENTS = 1 << 26
"""Largest ``tokens x vocabulary`` of a micro-batch whose chunks keep their ``[t, V]`` logits for
backward (128 MiB in bf16, 256 MiB in float32) instead of recomputing them: a recomputation costs
another ``lm_head`` product and ``log_softmax`` per chunk (timed: benchmarks/README.md, "Log-probs")."""



def _chunk_stats(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: nn.Module,
    temperature: float,
    softcap: float | None,
    calculate_entropy: bool,
    entropy_grad: bool,
    sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """hidden ``[t, H]``, labels ``[t]`` -> (log-prob ``[t]``, entropy ``[t]`` or empty[, sum of pi^2 ``[t]``])
    in float32."""
    logits = head(hidden).float()  # [t, V]: the only vocab-sized tensor, one chunk at a time
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if sum_pi_squared:
        return logprob_entropy_sum_pi_squared(_divided(logits, temperature), labels, calculate_entropy)
    return logprob_and_entropy(_divided(logits, temperature), labels, calculate_entropy, entropy_grad)


def _divided(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature``; x / 1 == x, so a temperature of 1 skips a pass over the ``[t, V]`` chunk."""
    return logits / temperature if temperature != 1.0 else logits


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


def _keeps_logits(rows: int, vocab: int) -> bool:
    """Whether a micro-batch of ``rows`` scored tokens keeps its chunks' logits for backward (else recomputes them)."""
    return rows * vocab <= KEEP_ELEMENTS


def _chunked(fn: Callable, hidden: torch.Tensor, labels: torch.Tensor, vocab: int, use_ckpt: bool):
    """``fn(h, y)`` per chunk of rows; each of its outputs concatenated over the chunks."""
    rows = _rows_per_chunk(vocab)
    use_ckpt = use_ckpt and not _keeps_logits(hidden.shape[0], vocab)
    parts = [checkpoint(fn, h, y, use_reentrant=False) if use_ckpt else fn(h, y)
             for h, y in zip(hidden.split(rows), labels.split(rows))]
    return tuple(torch.cat(outputs) for outputs in zip(*(parts or [fn(hidden, labels)])))


def head_logprobs(hidden, labels, head, temperature, softcap, calculate_entropy, entropy_grad, sum_pi_squared=False):
    """hidden ``[T, H]``, labels ``[T]`` -> (log-prob ``[T]``, entropy ``[T]`` or empty[, sum of pi^2 ``[T]``]),
    float32: step 4. The sum of pi^2 is computed without gradient only (the old-log-prob pass)."""
    if sum_pi_squared:
        if torch.is_grad_enabled():
            raise ValueError("the sum of pi^2 is computed without gradient (the old-log-prob pass): run it under "
                             "torch.no_grad()")
        fn = lambda h, y: _chunk_stats(h, y, head, temperature, softcap, calculate_entropy, False, True)  # noqa: E731
        return _chunked(fn, hidden, labels, head.weight.shape[0], False)
    if torch.is_grad_enabled() and is_plain_linear_head(head, softcap):
        dtype = low_dtype(hidden, head.weight) or head.weight.dtype  # autocast's for a float32 weight
        return _LinearHeadLogProbs.apply(hidden, head.weight, labels, temperature, calculate_entropy, entropy_grad,
                                         dtype, _keeps_logits(hidden.shape[0], head.weight.shape[0]),
                                         grad_accumulator(head.weight))
    fn = lambda h, y: _chunk_stats(h, y, head, temperature, softcap, calculate_entropy, entropy_grad)  # noqa: E731
    return _chunked(fn, hidden, labels, head.weight.shape[0], torch.is_grad_enabled())


def is_plain_linear_head(head: nn.Module, softcap: float | None) -> bool:
    """A head whose call is nothing but ``hidden @ weight.T``: exactly an ``nn.Linear`` or `RecastLinear`
    (not a LoRA wrapper, not an FSDP unit: its hooks gather the weight), no bias, no hooks, no softcap."""
    return (type(head) in (nn.Linear, RecastLinear) and head.bias is None and not softcap
            and not (head._forward_hooks or head._forward_pre_hooks))


class _LinearHeadLogProbs(torch.autograd.Function):
    """``lm_head`` + log-prob/entropy of a micro-batch's ``[T, H]`` hidden states, chunk by chunk, as one
    autograd node that keeps the logits in the compute dtype (bf16 under autocast) instead of float32.

    Through autograd, each chunk would keep its float32 softmax ``[t, V]``, and its backward would build a
    float32 logit gradient ``[t, V]``, its bf16 cast, the weight's gradient in bf16 and again in float32, on
    top of the tied weight's running sum. Here forward computes the same bits as that path (the same bf16
    product, ``.float()``, temperature, `logprob_and_entropy`) and keeps the chunk's bf16 logits (half of
    the float32 softmax) and each row's logsumexp; or, past ``KEEP_ELEMENTS``, nothing (backward recomputes
    the chunk's logits, as the checkpointed path does). Backward walks the vocabulary in ``VOCAB_SLICE``
    columns: softmax from the kept logits, the logit gradient (`logit_gradient`, the same formula), and its
    two products, so the largest temporaries are a few ``[t, VOCAB_SLICE]`` slices and the weight's gradient
    is one tensor (float32 for a float32 weight) summed into slice by slice.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature: float, calculate_entropy: bool, entropy_grad: bool,
                dtype: torch.dtype, keep: bool, accumulator: Any):
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not a zero tensor
        rows = _rows_per_chunk(weight.shape[0])
        with torch.autocast(hidden.device.type, enabled=False):  # the casts are ours, as in `RecastLinear`
            hidden_low = hidden.to(dtype)
            logits = _logits_by_chunk(hidden_low.split(rows), weight)
            if keep:  # every product first: the weight's cast is freed before the float32 passes
                logits = list(logits)
            stats = [_chunk_forward(z, y, temperature, calculate_entropy) for z, y in zip(logits, labels.split(rows))]
        logp, entropy, logsumexp = (torch.cat(parts) for parts in zip(*stats))
        ctx.rows, ctx.temperature, ctx.hidden_dtype = rows, temperature, hidden.dtype
        ctx.accumulator = accumulator  # weight's AccumulateGrad node where it may add into .grad itself, else None
        ctx.entropy_grad = calculate_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(hidden_low, weight, labels, logsumexp, entropy, *(logits if keep else ()))
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden_low, weight, labels, logsumexp, entropy, *kept = ctx.saved_tensors
        if not ctx.entropy_grad or grad_entropy is None:
            grad_entropy = entropy = None  # no entropy term in the logits' gradient
        if grad_logp is None and grad_entropy is None:
            return (None,) * 9
        if grad_logp is None:
            grad_logp = torch.zeros_like(logsumexp)
        into_param = ctx.needs_input_grad[1] and adds_into_grad(weight, ctx.accumulator)
        grads = _HeadGrads(hidden_low, weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1], into_param)
        with torch.autocast(hidden_low.device.type, enabled=False):
            for i, start in enumerate(range(0, max(1, labels.shape[0]), ctx.rows)):
                rows = slice(start, start + ctx.rows)
                h = hidden_low[rows]
                z = kept[i] if kept else F.linear(h, weight.to(h.dtype))  # recomputed: the forward's bits
                needs = _LogitGrad(logsumexp[rows], grad_logp[rows], _rows_of(entropy, rows),
                                   _rows_of(grad_entropy, rows), ctx.temperature)
                grads.add_chunk(rows, z, labels[rows], needs)
        return grads.hidden_grad(ctx.hidden_dtype), grads.weight_grad(), *(None,) * 7


def _logits_by_chunk(hidden_chunks, weight):
    """Each chunk's logits ``[t, V]`` in the chunks' dtype, from one cast of the weight (held until the last)."""
    weight_low = weight.to(hidden_chunks[0].dtype)  # (split always gives a chunk, an empty one for no rows)
    for h in hidden_chunks:
        yield F.linear(h, weight_low)


def _chunk_forward(z: torch.Tensor, labels: torch.Tensor, temperature: float, calculate_entropy: bool):
    """A chunk's logits ``z`` ``[t, V]`` -> (log-prob, entropy or empty, logsumexp), each ``[t]`` float32.

    The float32 work runs ``FLOAT32_ROWS`` rows at a time (every step is row by row, so the values are the
    same): a whole chunk's float32 copy, log-softmax and softmax would be 0.2 GB beside the kept logits."""
    step = _piece(z, 0, FLOAT32_ROWS)
    parts = [_rows_forward(z[r:r + step], labels[r:r + step], temperature, calculate_entropy)
             for r in range(0, max(1, z.shape[0]), step)]
    return tuple(torch.cat(part) for part in zip(*parts))


def _rows_forward(z: torch.Tensor, labels: torch.Tensor, temperature: float, calculate_entropy: bool):
    logits = _divided(z.float(), temperature)
    logp, entropy = logprob_and_entropy(logits, labels, calculate_entropy)
    # log p_y = z_y - logsumexp(z): the label's logit gives it without another pass over the rows
    logsumexp = logits.gather(1, labels[:, None]).squeeze(1) - logp
    return logp, entropy, logsumexp


FLOAT32_ROWS = 64
"""Rows of a chunk `_chunk_forward` turns to float32 at once: 12.6 MB a tensor for SmolLM2's 49152 words."""


VOCAB_SLICE = 8192
"""Vocabulary columns `_LinearHeadLogProbs`'s backward handles at once: a float32 ``[t, VOCAB_SLICE]`` is
11 MB for a 341-row chunk."""


def _piece(z: torch.Tensor, dim: int, cpu_size: int) -> int:
    """How much of a chunk's ``[t, V]`` logits ``z`` (along ``dim``) one float32 pass takes.

    ``cpu_size`` on a CPU, where small pieces stay in cache and in the heap's reuse (a small model with
    SmolLM2's vocabulary: a micro-batch's forward + backward took 0.45 s in 8192-column slices, 0.75 s whole);
    the whole chunk elsewhere, where each piece costs kernel launches and a chunk's float32 temporaries are
    what autograd's path holds anyway (on an H200, a micro-batch took 0.50 s in the CPU's pieces against
    autograd's 0.20 s; benchmarks/gpu_check.py ``lean``)."""
    return cpu_size if z.device.type == "cpu" else max(1, z.shape[dim])


class _LogitGrad(NamedTuple):
    """What a chunk's logit gradient needs beside its logits, per row ``[t]`` (the entropy's: None without one)."""

    logsumexp: torch.Tensor
    grad_logp: torch.Tensor
    entropy: torch.Tensor | None
    grad_entropy: torch.Tensor | None
    temperature: float

    def of_columns(self, z: torch.Tensor, labels: torch.Tensor, cols: slice) -> torch.Tensor:
        """float32 gradient with respect to the logits ``z[:, cols]`` (before the temperature's division)."""
        log_p = z[:, cols].to(torch.float32, copy=True)  # a copy even of float32 logits: the kept ones stay intact
        if self.temperature != 1.0:
            log_p.div_(self.temperature)
        log_p.sub_(self.logsumexp[:, None])
        grad = logit_gradient(log_p.exp(), self.grad_logp, labels - cols.start, log_p, self.entropy,
                              self.grad_entropy, reuse=True)
        return grad.div_(self.temperature) if self.temperature != 1.0 else grad  # d(z / T)/dz = 1 / T


def _rows_of(values: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if values is None else values[rows]


class _HeadGrads:
    """The gradients of the hidden states (summed in float32) and of the head's weight (one tensor in its dtype,
    not one per chunk), each a sum over chunks and vocabulary slices of products in the compute dtype. With
    ``into_param`` (`posttrain.models.lean.into_grad`) the weight's is summed into ``weight.grad`` itself, made if None."""

    def __init__(self, hidden_low: torch.Tensor, weight: torch.Tensor, hidden_needed: bool, weight_needed: bool,
                 into_param: bool = False):
        self.hidden_low, self.full_weight, self.into_param = hidden_low, weight, into_param
        self.hidden = hidden_low.new_zeros(hidden_low.shape, dtype=torch.float32) if hidden_needed else None
        self.weight = None
        if into_param and weight.grad is not None:
            self.weight = weight.grad
        elif weight_needed:
            self.weight = torch.zeros_like(weight)

    def add_chunk(self, rows: slice, z: torch.Tensor, labels: torch.Tensor, logit_grad: _LogitGrad) -> None:
        h = self.hidden_low[rows]
        step = _piece(z, 1, VOCAB_SLICE)
        for start in range(0, z.shape[1], step):
            cols = slice(start, start + step)
            grad = logit_grad.of_columns(z, labels, cols).to(h.dtype)  # the product's dtype, as `.float()`'s backward
            if self.hidden is not None:
                self.hidden[rows].add_(grad @ self.full_weight[cols].to(h.dtype))
            if self.weight is not None:
                self.weight[cols].add_(grad.t() @ h)

    def hidden_grad(self, dtype: torch.dtype) -> torch.Tensor | None:
        return None if self.hidden is None else self.hidden.to(dtype)

    def weight_grad(self) -> torch.Tensor | None:
        """What backward returns for the weight: None once the sum is in ``weight.grad``."""
        if not self.into_param:
            return self.weight
        if self.full_weight.grad is None:
            self.full_weight.grad = self.weight
        return None
