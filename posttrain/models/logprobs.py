"""Log-probabilities and entropy of response tokens, without ``[batch, seq, vocab]`` float32 tensors.

Shapes: ``N`` rows, ``P`` prompt length (left-padded), ``R`` response length (right-padded),
``S = P + R``, ``H`` hidden size, ``V`` vocabulary, ``T`` valid response tokens of a micro-batch.

How one micro-batch is computed (``response_logprobs``):

1. columns that are padding in *every* row are dropped (common left padding of prompts and the
   tail after the longest response); positions are passed explicitly, so this is exact. With
   ``remove_padding`` (verl's ``use_remove_padding``) all valid tokens are packed into one row
   instead (no padding at all; with SDPA the block-diagonal mask is dense, ``T_total^2``); with
   ``shared_prefix`` (verl's ``use_prefix_grouper``) rows that share a prompt become one row that
   encodes the prompt once (`posttrain.models.shared_prefix`);
2. the backbone (``model.model`` for Llama) runs once -> hidden ``[B, S', H]``;
3. only hidden states that *predict a valid response token* are kept -> ``[T, H]`` (the state at
   column ``P - 1 + j`` predicts response token ``j``; tokens after EOS are skipped);
4. ``lm_head`` + log-softmax run over chunks of those ``T`` rows: each chunk's logits ``[t, V]``
   are upcast to float32, divided by the temperature (as verl does), and reduced to a log-prob and
   an entropy per token (`posttrain.algorithms.logprobs.logprob_and_entropy`, the one copy of that
   math). With gradients on and a plain bias-free linear head, all chunks are one autograd node
   (`_LinearHeadLogProbs`, the same forward bits) that keeps each chunk's logits in the compute
   dtype (bf16 under autocast: half of the float32 softmax autograd would keep) and a logsumexp per
   row, while the micro-batch's total stays within ``KEEP_ELEMENTS`` logits, else nothing (backward
   recomputes each chunk's logits). Its backward walks the vocabulary in slices, so no float32
   ``[t, V]`` gradient, no bf16 copy of the weight and one float32 weight gradient exist: the
   backward of the actor update's lm_head was the step's memory peak. Inside
   `posttrain.models.into_grad.grads_into_params` (the update engine's micro-step) that gradient is
   summed into ``weight.grad`` itself, rather than handed to autograd (which holds it to the end of
   backward for a tied embedding). Other heads (a LoRA wrapper, a bias, Gemma's softcap, an FSDP unit
   of its own) go through autograd chunk by chunk: each chunk keeps its float32 softmax within
   ``KEEP_ELEMENTS``, beyond it is checkpointed.

Positions that are not valid response tokens get log-prob 0 and entropy 0.

``calculate_sum_pi_squared`` (the old-log-prob pass of ``actor.calculate_sum_pi_squared``, no gradient)
also returns each token's ``sum_v pi_v^2`` from the same chunks' softmax (a third ``[B, R]`` tensor).

Under FSDP2 (``posttrain.distributed.fsdp.shard_model``) the backbone and ``lm_head`` calls run
inside the root unit's forward hooks (:func:`call_as_forward`), and ``compute_response_logprobs``
runs the same number of micro-batches on every rank (``equal_micro_batch_count``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from posttrain.algorithms.logprobs import logit_gradient, logprob_and_entropy, logprob_entropy_sum_pi_squared
from posttrain.models.attention import fast_cpu_attention
from posttrain.models.compile import compiled_layers
from posttrain.models.into_grad import adds_into_grad, grad_accumulator
from posttrain.models.lean_backward import RecastLinear, low_dtype
from posttrain.models.microbatch import equal_micro_batch_count, forward_micro_batches, is_sharded
from posttrain.models.shared_prefix import prompt_key, shared_prefix_hidden_states, take_columns

__all__ = ["FSDP_CALL_ATTR", "call_as_forward", "compute_response_logprobs", "forget_forward_record",
           "response_logprobs", "response_hidden_states", "split_lm"]

FSDP_CALL_ATTR = "posttrain_fsdp_call"
"""Name of the FSDP forward method ``shard_model`` registers on a sharded root: ``root.<name>(fn, *args)``."""


def call_as_forward(model: nn.Module, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, run as ``model``'s forward when ``model`` is an FSDP-sharded root.

    Calling ``model.base_model`` and ``lm_head`` directly skips the root's forward hooks, which
    gather the parameters the root unit owns (final norm, tied embedding) and prepare backward.
    For any other model this is a plain call.
    """
    runner = getattr(model, FSDP_CALL_ATTR, None)
    return runner(fn, *args, **kwargs) if runner is not None else fn(*args, **kwargs)

CHUNK_ELEMENTS = 1 << 24  # logits elements per chunk: 16M floats = 64 MiB in float32
KEEP_ELEMENTS = 1 << 26
"""Largest ``tokens x vocabulary`` of a micro-batch whose chunks keep their ``[t, V]`` logits for
backward (128 MiB in bf16, 256 MiB in float32) instead of recomputing them: a recomputation costs
another ``lm_head`` product and ``log_softmax`` per chunk (timed: benchmarks/README.md, "Log-probs")."""


def split_lm(model: nn.Module) -> tuple[nn.Module, nn.Module, float | None] | None:
    """``(backbone, lm_head, final_logit_softcapping)`` of a HF causal LM, or None if not split-able."""
    body = getattr(model, "base_model", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if body is None or body is model or head is None:
        return None
    return body, head, getattr(model.config, "final_logit_softcapping", None)


def _column_window(attention_mask: torch.Tensor, response_length: int) -> tuple[int, int, int]:
    """``(lo, hi, take)``: run columns ``[lo, hi)``; ``take`` response positions are scored."""
    seq_len = attention_mask.shape[1]
    prompt_len = seq_len - response_length
    used = attention_mask.bool().any(0).nonzero().flatten()
    lo = int(used[0]) if used.numel() else prompt_len - 1
    last = int(used[-1]) + 1 if used.numel() else prompt_len
    take = max(1, min(response_length, last - prompt_len))
    lo = min(lo, prompt_len - 1)
    return lo, prompt_len - 1 + take, take


def _packed_hidden_states(backbone, input_ids, attention_mask, position_ids, response_length):
    """Padding-free forward: all valid tokens in one row, sequences told apart by positions restarting
    at 0 (transformers builds a block-diagonal causal mask when ``attention_mask`` is None)."""
    keep = attention_mask.bool()
    first = keep.long().argmax(-1, keepdim=True)
    if bool((position_ids.gather(1, first) != 0).any()):
        raise ValueError("use_remove_padding needs position_ids = clip(cumsum(attention_mask) - 1, 0)")
    out = backbone(input_ids=input_ids[keep][None], position_ids=position_ids[keep][None],
                   attention_mask=None, use_cache=False)
    flat = out.last_hidden_state[0]  # [T_total, H]
    flat_index = keep.flatten().long().cumsum(0).view_as(keep) - 1  # [B, S] row/col -> packed index
    seq_len = keep.shape[1]
    cols = flat_index[:, seq_len - response_length - 1:seq_len - 1].clamp(min=0)  # [B, R]
    return take_columns(flat, cols), response_length  # positions after EOS hold unrelated states; callers mask them


def response_hidden_states(
    backbone: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    remove_padding: bool = False,
    shared_prefix: bool = False,
) -> tuple[torch.Tensor, int]:
    """Hidden states that predict response tokens: ``([B, take, H], take)`` with ``take <= R``.

    ``hidden[:, j]`` is the backbone output at column ``P - 1 + j`` (it predicts response token ``j``).
    ``remove_padding`` packs the valid tokens of all rows into one sequence (verl's
    ``use_remove_padding``); ``shared_prefix`` encodes each distinct prompt once for all its
    responses (verl's ``use_prefix_grouper``, `posttrain.models.shared_prefix`) when that computes
    less; otherwise only columns that are padding in every row are dropped.
    """
    if remove_padding and shared_prefix:
        raise ValueError("use_remove_padding and use_prefix_grouper are two different layouts; set one of them")
    with fast_cpu_attention(backbone):
        if remove_padding:
            return _packed_hidden_states(backbone, input_ids, attention_mask, position_ids, response_length)
        lo, hi, take = _column_window(attention_mask, response_length)
        if shared_prefix:  # the window up to the last scored token: its responses are `take` long
            end = hi + 1
            hidden = shared_prefix_hidden_states(backbone, input_ids[:, lo:end], attention_mask[:, lo:end],
                                                 position_ids[:, lo:end], take)
            if hidden is not None:
                return hidden, take
        out = backbone(
            input_ids=input_ids[:, lo:hi],
            attention_mask=attention_mask[:, lo:hi],
            position_ids=position_ids[:, lo:hi],
            use_cache=False,
        )
    return out.last_hidden_state[:, -take:], take


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


def _head_logprobs(hidden, labels, head, temperature, softcap, calculate_entropy, entropy_grad, sum_pi_squared=False):
    """hidden ``[T, H]``, labels ``[T]`` -> (log-prob ``[T]``, entropy ``[T]`` or empty[, sum of pi^2 ``[T]``]),
    float32: step 4. The sum of pi^2 is computed without gradient only (the old-log-prob pass)."""
    if sum_pi_squared:
        if torch.is_grad_enabled():
            raise ValueError("the sum of pi^2 is computed without gradient (the old-log-prob pass): run it under "
                             "torch.no_grad()")
        fn = lambda h, y: _chunk_stats(h, y, head, temperature, softcap, calculate_entropy, False, True)  # noqa: E731
        return _chunked(fn, hidden, labels, head.weight.shape[0], False)
    if torch.is_grad_enabled() and _is_plain_linear_head(head, softcap):
        dtype = low_dtype(hidden, head.weight) or head.weight.dtype  # autocast's for a float32 weight
        return _LinearHeadLogProbs.apply(hidden, head.weight, labels, temperature, calculate_entropy, entropy_grad,
                                         dtype, _keeps_logits(hidden.shape[0], head.weight.shape[0]),
                                         grad_accumulator(head.weight))
    fn = lambda h, y: _chunk_stats(h, y, head, temperature, softcap, calculate_entropy, entropy_grad)  # noqa: E731
    return _chunked(fn, hidden, labels, head.weight.shape[0], torch.is_grad_enabled())


def _is_plain_linear_head(head: nn.Module, softcap: float | None) -> bool:
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
    ``into_param`` (`posttrain.models.into_grad`) the weight's is summed into ``weight.grad`` itself, made if None."""

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


def response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    responses: torch.Tensor,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    entropy_grad: bool = True,
    remove_padding: bool = False,
    shared_prefix: bool = False,
    calculate_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """One micro-batch: log-probs (and entropy) of ``responses`` ``[B, R]`` under ``model``.

    input_ids/attention_mask/position_ids: ``[B, P+R]``. Differentiable when grad is enabled
    (``entropy_grad=False`` computes the entropy without a graph). Returns float32 ``[B, R]``
    tensors; positions masked in ``attention_mask[:, P:]`` are 0. ``remove_padding``,
    ``shared_prefix``: see :func:`response_hidden_states`. ``calculate_sum_pi_squared`` (no gradient):
    a third tensor, each token's ``sum_v pi_v^2``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    return call_as_forward(model, _response_logprobs, model, input_ids, attention_mask, position_ids, responses,
                           temperature, calculate_entropy, entropy_grad, remove_padding, shared_prefix,
                           calculate_sum_pi_squared)


def _response_logprobs(model, input_ids, attention_mask, position_ids, responses, temperature,
                       calculate_entropy, entropy_grad, remove_padding, shared_prefix, sum_pi_squared=False):
    batch, resp_len = responses.shape
    parts = split_lm(model)
    if parts is None:
        return _full_logits_logprobs(model, input_ids, attention_mask, position_ids, responses,
                                     temperature, calculate_entropy, sum_pi_squared)
    backbone, head, softcap = parts
    with compiled_layers(model):  # compile_layers=True: the decoder layers through torch.compile
        hidden, take = response_hidden_states(backbone, input_ids, attention_mask, position_ids, resp_len,
                                              remove_padding, shared_prefix)
    valid = attention_mask[:, -resp_len:][:, :take].bool()  # [B, take]
    labels = responses[:, :take][valid]  # [T]
    lp_flat, ent_flat, *sum_pi2_flat = _head_logprobs(hidden[valid], labels, head, temperature, softcap,
                                                      calculate_entropy, entropy_grad, sum_pi_squared)
    full_valid = torch.zeros(batch, resp_len, dtype=torch.bool, device=responses.device)
    full_valid[:, :take] = valid
    at = full_valid.nonzero(as_tuple=True)
    log_probs = torch.zeros(batch, resp_len, dtype=torch.float32, device=responses.device)
    log_probs = log_probs.index_put(at, lp_flat)
    entropy = torch.zeros_like(log_probs).index_put(at, ent_flat) if calculate_entropy else None
    if sum_pi_squared:
        return log_probs, entropy, torch.zeros_like(log_probs).index_put(at, sum_pi2_flat[0])
    return log_probs, entropy


def _full_logits_logprobs(model, input_ids, attention_mask, position_ids, responses, temperature, calc_entropy,
                          sum_pi_squared=False):
    """Fallback for models without a separate backbone/lm_head: slice ``[B, R, V]`` logits."""
    resp_len = responses.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits[:, -resp_len - 1:-1].float() / temperature
    mask = attention_mask[:, -resp_len:].to(torch.float32)
    vocab = logits.shape[-1]
    if sum_pi_squared:
        lp, ent, sum_pi2 = logprob_entropy_sum_pi_squared(logits.reshape(-1, vocab), responses.reshape(-1),
                                                          calc_entropy)
        ent = ent.view_as(mask) * mask if calc_entropy else None
        return lp.view_as(mask) * mask, ent, sum_pi2.view_as(mask) * mask
    lp, ent = logprob_and_entropy(logits.reshape(-1, vocab), responses.reshape(-1), calc_entropy)
    lp = lp.view_as(mask) * mask
    return lp, (ent.view_as(mask) * mask if calc_entropy else None)


def _tensors(data: Any) -> dict[str, torch.Tensor]:
    keys = ("input_ids", "attention_mask", "position_ids", "responses")
    return {k: data[k] for k in keys}


def compute_response_logprobs(
    model: nn.Module,
    data: Any,
    micro_batch_size: int | None = None,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    *,
    use_dynamic_bsz: bool = False,
    max_token_len: int | None = None,
    autocast: Any = None,
    remove_padding: bool = False,
    shared_prefix: bool = False,
    calculate_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Log-probs ``[N, R]`` (and entropy ``[N, R]`` or None) of ``data['responses']`` under ``model``;
    with ``calculate_sum_pi_squared`` a third ``[N, R]`` tensor, each token's ``sum_v pi_v^2``.

    data: a ``Batch`` or mapping with ``input_ids``, ``attention_mask``, ``position_ids`` ``[N, P+R]``
    and ``responses`` ``[N, R]``. Runs in micro-batches of ``micro_batch_size`` rows (or by
    ``max_token_len`` tokens with ``use_dynamic_bsz``), padding-free with ``remove_padding``, each
    distinct prompt encoded once with ``shared_prefix`` (its rows kept in one micro-batch), inside
    the ``autocast`` context-manager factory when given, without gradients. Logits are divided by
    ``temperature``. Results are on ``data``'s device.
    """
    tensors = _tensors(data)
    device = next(model.parameters()).device
    n, resp_len = tensors["responses"].shape
    prompts = prompt_key(tensors["input_ids"], tensors["attention_mask"], resp_len) if shared_prefix else None
    groups = forward_micro_batches(tensors["attention_mask"], micro_batch_size, use_dynamic_bsz, max_token_len, prompts)
    # under FSDP each forward is a collective: every rank runs the same number (padding ones are dropped)
    plan = equal_micro_batch_count(groups) if is_sharded(model) else [(g, False) for g in groups]
    out_device = tensors["responses"].device
    log_probs = torch.zeros(n, resp_len, dtype=torch.float32, device=out_device)
    entropy = torch.zeros_like(log_probs) if calculate_entropy else None
    sum_pi_squared = torch.zeros_like(log_probs) if calculate_sum_pi_squared else None
    # one autocast region for all micro-batches: autocast caches the bf16 casts of the weights
    ctx = autocast() if autocast is not None else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        for idx, padding in plan:
            mb = _stand_in_row(tensors) if not idx.numel() else {k: v[idx.to(v.device)] for k, v in tensors.items()}
            mb = {k: v.to(device) for k, v in mb.items()}
            lp, ent, *sum_pi2 = response_logprobs(model, **mb, temperature=temperature,
                                                  calculate_entropy=calculate_entropy, remove_padding=remove_padding,
                                                  shared_prefix=shared_prefix,
                                                  calculate_sum_pi_squared=calculate_sum_pi_squared)
            if padding:
                continue
            log_probs[idx.to(out_device)] = lp.to(out_device)
            if entropy is not None:
                entropy[idx.to(out_device)] = ent.to(out_device)
            if sum_pi_squared is not None:
                sum_pi_squared[idx.to(out_device)] = sum_pi2[0].to(out_device)
    forget_forward_record(model)
    return (log_probs, entropy) if sum_pi_squared is None else (log_probs, entropy, sum_pi_squared)


def forget_forward_record(model: nn.Module) -> None:
    """Clear FSDP2's record of the forwards just run (kept for backward prefetching).

    FSDP2 appends every forward to a list that only a backward clears; a forward-only model (the
    reference) would grow it for the whole run. ``reset_iter_state`` clears it and reshards (no
    collectives); skipped inside ``gathered_for_generation``, which keeps parameters gathered.
    """
    reset = getattr(model, "reset_iter_state", None)  # FSDP roots (absent in older torch: nothing to do)
    if reset is not None and not getattr(getattr(model, "posttrain_fsdp", None), "gathered", False):
        reset()


def _stand_in_row(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One all-valid row of token 0 (``[1, P+R]``, ``[1, R]``) for a rank that got no rows but must
    still run the forwards of the others' micro-batches; its output is discarded."""
    seq_len, resp_len = tensors["input_ids"].shape[1], tensors["responses"].shape[1]
    ids = torch.zeros(1, seq_len, dtype=tensors["input_ids"].dtype)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(seq_len)[None],
            "responses": torch.zeros(1, resp_len, dtype=tensors["responses"].dtype)}
