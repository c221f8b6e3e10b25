"""Top-k log-probabilities of response positions, for on-policy distillation's ``forward_kl_topk``.

Shapes: ``N`` rows, ``R`` response length, ``K`` top-k, ``V`` vocabulary, ``T`` valid response tokens.

The teacher (no gradient) needs, per response position, its ``K`` most likely tokens and their log-probs
(and the sampled token's log-prob); the student (with gradient) needs its log-probs at the teacher's
tokens (and at the sampled token, and its own top-k tokens for the overlap diagnostics). Both start from the
same steps as `posttrain.models.logprobs`: the hidden states that predict response tokens only
(`response_hidden_states`: padding columns dropped, ``remove_padding``, ``shared_prefix``). The teacher's then
run ``lm_head`` and a float32 log-softmax chunk by chunk (``CHUNK_ELEMENTS`` logits at a time), so no
``[N, R, V]`` tensor exists. The student's, with a plain linear head, go through the RL update's own lean
head for the sampled token (`_through_the_lean_head`) and reach the teacher's tokens from it with ``K + 1``
rows of the head; with another head (a bias, a softcap, a wrapper), chunk by chunk with autograd, each
chunk (``TRAIN_CHUNK_ELEMENTS`` logits) recomputed in backward. Log-probs are of ``logits / temperature``.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from posttrain.models.compile import compiled_layers
from posttrain.models.lean.backward import low_dtype
from posttrain.models.lean.head import CHUNK_ELEMENTS, head_logprobs, is_plain_linear_head
from posttrain.models.lean.into_grad import _EmbeddingIntoGrad, grad_accumulator  # the embedding's row-wise backward
from posttrain.models.logprobs import call_as_forward, forget_forward_record, response_hidden_states, split_lm
from posttrain.models.microbatch import equal_micro_batch_count, forward_micro_batches, is_sharded
from posttrain.models.shared_prefix import prompt_key

__all__ = ["TopkLogProbs", "compute_response_topk", "response_topk_logprobs"]


class TopkLogProbs(NamedTuple):
    """One pass's results, float32 log-probs; 0 (ids: 0) at positions that are not valid response tokens.

    log_probs: ``[N, R]`` of the sampled tokens. entropy: ``[N, R]`` or None.
    at_ids: ``[N, R, K]`` at the given ids (None without ids). topk_ids, topk_log_probs: ``[N, R, k]`` the
    ``k`` most likely tokens, highest first (None without k; no gradient)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    at_ids: torch.Tensor | None
    topk_ids: torch.Tensor | None
    topk_log_probs: torch.Tensor | None


def response_topk_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           position_ids: torch.Tensor, responses: torch.Tensor, *, ids: torch.Tensor | None = None,
                           k: int | None = None, temperature: float = 1.0, calculate_entropy: bool = False,
                           entropy_grad: bool = True, remove_padding: bool = False,
                           shared_prefix: bool = False) -> TopkLogProbs:
    """One micro-batch (``[B, P+R]`` inputs, ``[B, R]`` responses): log-probs of the sampled tokens, of
    ``ids`` ``[B, R, K]`` when given (differentiable under grad), and the top ``k`` tokens when ``k`` is set."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    return call_as_forward(model, _one_micro_batch, model, input_ids, attention_mask, position_ids, responses, ids, k,
                           temperature, calculate_entropy, entropy_grad, remove_padding, shared_prefix)


def _one_micro_batch(model, input_ids, attention_mask, position_ids, responses, ids, k, temperature,
                     calculate_entropy, entropy_grad, remove_padding, shared_prefix) -> TopkLogProbs:
    batch, resp_len = responses.shape
    parts = split_lm(model)
    if parts is None:  # no separate backbone and head: the full logits of the response positions
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False).logits[:, -resp_len - 1:-1]
        take, valid = resp_len, attention_mask[:, -resp_len:].bool()
        hidden, head, softcap = logits[valid], None, None
    else:
        backbone, head, softcap = parts
        with compiled_layers(model):
            states, take = response_hidden_states(backbone, input_ids, attention_mask, position_ids, resp_len,
                                                  remove_padding, shared_prefix)
        valid = attention_mask[:, -resp_len:][:, :take].bool()
        hidden = states[valid]  # [T, H]
    labels = responses[:, :take][valid]
    flat_ids = ids[:, :take][valid] if ids is not None else None
    vocab = head.weight.shape[0] if head is not None else hidden.shape[-1]
    if flat_ids is not None and torch.is_grad_enabled() and head is not None and is_plain_linear_head(head, softcap):
        out = _through_the_lean_head(hidden, labels, flat_ids, head, temperature, k, calculate_entropy, entropy_grad)
    else:
        out = _chunked(hidden, labels, flat_ids, head, softcap, temperature, k, calculate_entropy, entropy_grad, vocab)
    full_valid = torch.zeros(batch, resp_len, dtype=torch.bool, device=responses.device)
    full_valid[:, :take] = valid
    where = full_valid.nonzero(as_tuple=True)

    def place(flat: torch.Tensor | None, tail: tuple[int, ...] = (), dtype=torch.float32) -> torch.Tensor | None:
        if flat is None:
            return None
        return torch.zeros(batch, resp_len, *tail, dtype=dtype, device=responses.device).index_put(where, flat)

    kk = () if k is None else (k,)
    return TopkLogProbs(place(out[0]), place(out[1]) if calculate_entropy else None,
                        place(out[2], (ids.shape[-1],) if ids is not None else ()), place(out[3], kk, torch.long),
                        place(out[4], kk))


def _through_the_lean_head(hidden, labels, ids, head, temperature, k, calculate_entropy, entropy_grad):
    """The student's path with gradients: the sampled tokens' log-probs (and entropy) from the RL update's own
    head (`posttrain.models.logprobs`: no ``[T, V]`` float32 tensor kept, its weight's gradient into ``.grad``),
    and the log-probs at ``ids`` from ``log p_i = (z_i - z_y) / T + log p_y``: the softmax's normaliser is
    ``z_y / T - log p_y``, so ``K + 1`` rows of the head per token give them, exactly, with their gradients.
    The student's own top-k ids (a diagnostic) from one more head product, ``TRAIN_CHUNK_ELEMENTS`` logits at a
    time, without gradients; its top-k log-probs are not computed (None)."""
    lp, entropy = head_logprobs(hidden, labels, head, temperature, None, calculate_entropy, entropy_grad)
    weight = head.weight
    dtype = low_dtype(hidden, weight) or weight.dtype  # the head product's dtype, as the lean path computes it
    rows = _head_rows(torch.cat([ids, labels[:, None]], 1).long(), weight)  # [T, K + 1, H]: the teacher's, the label
    with torch.autocast(hidden.device.type, enabled=False):
        z = torch.einsum("th,tkh->tk", hidden.to(dtype), rows.to(dtype)).float()  # [T, K + 1] logits at those rows
    at = (z[:, :-1] - z[:, -1:]) / temperature + lp[:, None]
    top_ids = None
    if k is not None:  # the student's own top-k tokens (ids only: the log-softmax keeps the logits' order)
        step = max(1, TRAIN_CHUNK_ELEMENTS // weight.shape[0])
        with torch.no_grad():
            top_ids = torch.cat([torch.topk(head(h), k, dim=-1).indices for h in hidden.detach().split(step)]) \
                if hidden.shape[0] else labels.new_zeros((0, k))
    return lp, entropy if calculate_entropy else None, at, top_ids, None


def _head_rows(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight[ids]``; inside the update's micro-step its backward adds the touched rows into ``weight.grad``
    (`posttrain.models.lean.into_grad`'s embedding lookup) rather than a dense vocabulary-sized gradient."""
    accumulator = grad_accumulator(weight)
    if accumulator is None:
        return F.embedding(ids, weight)
    return _EmbeddingIntoGrad.apply(ids, weight, None, accumulator)


TRAIN_CHUNK_ELEMENTS = 1 << 22
"""Logits per chunk with gradients (4M: 16 MiB in float32): each chunk is recomputed in backward, so the
update holds no ``[t, V]`` softmax between forward and backward, and a chunk's float32 temporaries in
backward (its logits, softmax and their gradients) stay near 64 MiB (SmolLM2: 85 rows)."""


def _chunked(hidden, labels, ids, head, softcap, temperature, k, calculate_entropy, entropy_grad, vocab):
    """Per chunk of rows: (log-prob [t], entropy [t], at ids [t, K], top ids [t, k], top log-probs [t, k]).

    Without gradients (the teacher) chunks of ``CHUNK_ELEMENTS`` logits; with them (the student) chunks of
    ``TRAIN_CHUNK_ELEMENTS``, recomputed in backward (checkpointing): one more ``lm_head`` product per chunk
    for a few hundred MB less at the update's peak. ``KEEP_ELEMENTS`` is the bound of the other path."""
    training = torch.is_grad_enabled()
    rows = max(1, (TRAIN_CHUNK_ELEMENTS if training else CHUNK_ELEMENTS) // max(1, vocab))
    recompute = training
    parts = []
    for start in range(0, max(1, hidden.shape[0]), rows):
        chunk = slice(start, start + rows)
        args = (hidden[chunk], labels[chunk], ids[chunk] if ids is not None else None)
        fn = lambda h, y, i: _chunk(h, y, i, head, softcap, temperature, k, calculate_entropy,  # noqa: E731
                                    entropy_grad)
        parts.append(checkpoint(fn, *args, use_reentrant=False) if recompute else fn(*args))
    return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts))


def _chunk(h, y, ids, head, softcap, temperature, k, calculate_entropy, entropy_grad):
    logits = (head(h) if head is not None else h).float()  # [t, V]
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    logp = F.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, y[:, None].long()).squeeze(-1)
    entropy = None
    if calculate_entropy:
        with (contextlib.nullcontext() if entropy_grad else torch.no_grad()):
            entropy = -(logp.exp() * logp).sum(-1)
    at = logp.gather(-1, ids.long()) if ids is not None else None
    top_values = top_ids = None
    if k is not None:
        top_values, top_ids = torch.topk(logp.detach(), k, dim=-1)
    return lp, entropy, at, top_ids, top_values


def compute_response_topk(model: nn.Module, data: Any, k: int, micro_batch_size: int | None = None, *,
                          use_dynamic_bsz: bool = False, max_token_len: int | None = None, autocast: Any = None,
                          remove_padding: bool = False, shared_prefix: bool = False) -> TopkLogProbs:
    """`response_topk_logprobs` over a whole batch without gradients (a frozen teacher, temperature 1), in
    micro-batches as `posttrain.models.logprobs.compute_response_logprobs` runs them (the same number on
    every rank of a sharded model). Results on ``data``'s device."""
    keys = ("input_ids", "attention_mask", "position_ids", "responses")
    tensors = {key: data[key] for key in keys}
    device = next(model.parameters()).device
    n, resp_len = tensors["responses"].shape
    prompts = prompt_key(tensors["input_ids"], tensors["attention_mask"], resp_len) if shared_prefix else None
    groups = forward_micro_batches(tensors["attention_mask"], micro_batch_size, use_dynamic_bsz, max_token_len,
                                   prompts) if n else []
    plan = equal_micro_batch_count(groups) if is_sharded(model) else [(g, False) for g in groups]
    out_device = tensors["responses"].device
    log_probs = torch.zeros(n, resp_len, dtype=torch.float32, device=out_device)
    top_ids = torch.zeros(n, resp_len, k, dtype=torch.long, device=out_device)
    top_lps = torch.zeros(n, resp_len, k, dtype=torch.float32, device=out_device)
    ctx = autocast() if autocast is not None else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        for idx, padding in plan:
            mb = _stand_in(tensors) if not idx.numel() else {key: v[idx.to(v.device)] for key, v in tensors.items()}
            res = response_topk_logprobs(model, **{key: v.to(device) for key, v in mb.items()}, k=k,
                                         remove_padding=remove_padding, shared_prefix=shared_prefix)
            if padding:
                continue
            rows = idx.to(out_device)
            log_probs[rows], top_ids[rows], top_lps[rows] = (res.log_probs.to(out_device),
                                                             res.topk_ids.to(out_device),
                                                             res.topk_log_probs.to(out_device))
    forget_forward_record(model)
    return TopkLogProbs(log_probs, None, None, top_ids, top_lps)


def _stand_in(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One all-valid row of token 0 for a rank with no rows that must still run the others' forwards."""
    seq_len, resp_len = tensors["input_ids"].shape[1], tensors["responses"].shape[1]
    ids = torch.zeros(1, seq_len, dtype=tensors["input_ids"].dtype)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(seq_len)[None],
            "responses": torch.zeros(1, resp_len, dtype=tensors["responses"].dtype)}
