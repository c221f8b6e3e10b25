"""CPU attention for ``transformers`` models on ``sdpa``: faster bf16 forward/backward and decoding.

torch's CPU ``scaled_dot_product_attention`` kernel (flash, blocked) is slow in two cases that
dominate posttrain's CPU runs (SmolLM2-135M, 1 thread, ``[32, 9, 114, 64]`` per layer; timings in
benchmarks/README.md, "CPU attention"):

- bf16 (autocast) forward + backward: about twice the time of two matmuls and a softmax;
- a one-token query while decoding: several times that of the plain products, most of a decoding step.

``fast_cpu_attention(model)`` switches a model whose ``config._attn_implementation`` is ``sdpa``
to ``posttrain_sdpa`` for the duration of a ``with`` block (autograd keeps what the forward chose,
so the backward may run outside; not with activation checkpointing, whose recomputation in
backward must choose the same function). ``posttrain_sdpa`` uses transformers' sdpa mask builder and:

- one-token queries on CPU: :func:`single_query_attention` (grouped-query heads packed, no ``repeat_kv``);
- multi-token queries on CPU computed in bf16/fp16 (autocast or half inputs), when the score
  tensor is small (``batch * heads * q * kv <= MAX_SCORE_ELEMENTS``): :func:`matmul_attention`,
  which in training keeps q, k and v for backward and recomputes the probabilities there
  (:class:`_RecomputedProbs`: autograd would keep 6 bytes a score);
- everything else (fp32, CUDA, long sequences): transformers' own ``sdpa`` function;
- a shared-prompt layout (``posttrain.models.shared_prefix``, which passes ``posttrain_prefix_slots``
  through the backbone): :func:`block_attention`, the beginning all prompts share, each prompt's own
  tokens and each response attended as separate blocks (each by the rules above) instead of one
  dense ``[W, W]`` mask.

The softmax runs in float32 (float64 inputs: float64); masked scores use the float32 minimum, not ``-inf``, so the query
rows of left padding (nothing to attend to) stay finite, as transformers' eager masks do.
Where transformers lacks ``AttentionInterface``/``AttentionMaskInterface`` (older versions) the
context manager does nothing.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import torch
from torch import nn

__all__ = ["ATTN_NAME", "AttentionBlocks", "MAX_SCORE_ELEMENTS", "PREFIX_SLOTS_KWARG", "QueryBlock",
           "block_attention", "fast_cpu_attention", "matmul_attention", "single_query_attention",
           "single_query_probs"]

ATTN_NAME = "posttrain_sdpa"
PREFIX_SLOTS_KWARG = "posttrain_prefix_slots"
"""Keyword a backbone passes through to its attention: the :class:`AttentionBlocks` of a shared-prompt layout."""
MAX_SCORE_ELEMENTS = 1 << 24
"""Largest ``batch * q_heads * q_len * kv_len`` computed with :func:`matmul_attention` (64 MiB of
float32 scores per layer while it runs, forward or backward); longer inputs use the memory-efficient
sdpa kernel."""

_state: dict[str, bool] = {}


def _grouped(query: torch.Tensor, key: torch.Tensor) -> tuple[int, int, int, int, int]:
    batch, q_heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    return batch, q_heads, q_len, dim, q_heads // kv_heads


def _mask_scores_(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """scores ``[B, Hkv, g, q, L]`` float32 (or float64), masked in place and returned: the caller's own
    scaled copy, so no other tensor of that size is made; mask ``[B|1, 1, q, L]`` bool (True = attend) or
    additive."""
    if mask is None:
        return scores
    mask = mask[:, :, None]  # [B|1, 1, 1, q, L]
    if mask.dtype == torch.bool:
        return scores.masked_fill_(~mask, torch.finfo(torch.float32).min)
    return scores.add_(mask.to(scores.dtype))


def single_query_probs(scores: torch.Tensor, mask: torch.Tensor | None, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Attention probabilities of one query token: scores ``[B, Hkv, g, L]`` scaled and softmaxed in
    float32 at least, mask ``[B|1, 1, 1, L]`` (bool, True = attend, or additive) applied as
    :func:`_mask_scores_` does; returned in ``dtype``."""
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    _mask_scores_(scores[:, :, :, None], mask)
    return torch.softmax(scores, dim=-1).to(dtype)


def single_query_attention(module: nn.Module, query, key, value, attention_mask, scaling: float | None = None):
    """One query token: ``[B, Hq, 1, d]`` x keys/values ``[B, Hkv, L, d]`` -> ``[B, 1, Hq, d]``."""
    batch, q_heads, _, dim, group = _grouped(query, key)
    scale = scaling if scaling is not None else dim ** -0.5
    q = query.reshape(batch, key.shape[1], group, dim)  # head h uses kv head h // group
    scores = torch.matmul(q, key.transpose(-1, -2))  # [B, Hkv, g, L]
    mask = attention_mask[..., -1:, :] if attention_mask is not None else None
    return torch.matmul(single_query_probs(scores, mask, scale, value.dtype), value).reshape(batch, 1, q_heads, dim)


def matmul_attention(module: nn.Module, query, key, value, attention_mask, scaling: float | None = None,
                     dropout: float = 0.0, is_causal: bool = True):
    """Causal (or masked) attention as matmul -> float32 softmax -> matmul, grouped-query heads packed.

    query ``[B, Hq, q, d]``, key/value ``[B, Hkv, L, d]``, mask ``[B|1, 1, q, L]`` or None (then
    causal, the queries being the last ``q`` positions). Returns ``[B, q, Hq, d]``. With gradients
    (and no dropout) the probabilities are not kept for backward: :class:`_RecomputedProbs`.
    """
    batch, q_heads, q_len, dim, group = _grouped(query, key)
    kv_heads, kv_len = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else dim ** -0.5
    q = query.reshape(batch, kv_heads, group * q_len, dim)
    if attention_mask is None and is_causal and q_len > 1:
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)[None, None]
    dropping = dropout > 0.0 and module.training
    if torch.is_grad_enabled() and not dropping and any(t.requires_grad for t in (query, key, value)):
        dtype = _compute_dtype(query, value)
        out = _RecomputedProbs.apply(q.to(dtype), key.to(dtype), value.to(dtype), attention_mask, scale, group)
    else:
        probs = _probabilities(q, key, attention_mask, scale, group).to(value.dtype)
        if dropping:
            probs = nn.functional.dropout(probs, p=dropout)
        out = torch.matmul(probs.view(batch, kv_heads, group * q_len, kv_len), value)
    return out.view(batch, kv_heads, group, q_len, dim).permute(0, 3, 1, 2, 4).reshape(batch, q_len, q_heads, dim)


def _probabilities(q: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   group: int) -> torch.Tensor:
    """Softmax (float32, float64 inputs: float64) of the masked, scaled scores: q ``[B, Hkv, g * q, d]``,
    key ``[B, Hkv, L, d]`` -> ``[B, Hkv, g, q, L]``. Scaled and masked in place on the scores' own upcast
    copy (two fewer passes over the largest tensor of the layer)."""
    batch, kv_heads, rows, _ = q.shape
    scores = torch.matmul(q, key.transpose(-1, -2))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).mul_(scale)
    scores = scores.view(batch, kv_heads, group, rows // group, -1)
    return torch.softmax(_mask_scores_(scores, mask), dim=-1)


def _compute_dtype(query: torch.Tensor, value: torch.Tensor) -> torch.dtype:
    """The dtype the products run in: autocast's on CPU when it is on, else the values' (as a matmul would)."""
    if query.device.type == "cpu" and _autocast_dtype() is not None:
        return _autocast_dtype()
    return torch.promote_types(query.dtype, value.dtype)


def _autocast_dtype() -> torch.dtype | None:
    try:
        on, dtype = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    except TypeError:  # torch < 2.4
        on, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    return dtype if on else None


class _RecomputedProbs(torch.autograd.Function):
    """``softmax(q k^T * scale + mask) v`` that keeps q, k and v for backward, not the probabilities.

    Autograd would keep the float32 probabilities (the softmax's output) and their bf16 cast (the
    second product's input): 6 bytes per score, 0.23 GB of a multi-turn micro-batch of 8 responses
    (SmolLM2-135M, 30 layers, a response block of 96 x 186 scores a head). Backward recomputes them
    from q and k instead (one more ``q k^T`` product and softmax: the same bits as the forward's), as
    flash attention does. The arithmetic is autograd's own, op for op: the forward's values and the
    gradients are the same bits as the plain path's (`tests/models/test_attention.py`).
    """

    @staticmethod
    def forward(ctx, q, key, value, mask, scale: float, group: int):
        ctx.save_for_backward(q, key, value, mask)
        ctx.scale, ctx.group = scale, group
        probs = _probabilities(q, key, mask, scale, group).to(value.dtype)
        return torch.matmul(probs.view(*q.shape[:3], key.shape[2]), value)

    @staticmethod
    def backward(ctx, grad_out):
        q, key, value, mask = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            probs = _probabilities(q, key, mask, ctx.scale, ctx.group)  # [B, Hkv, g, q, L], float32 at least
            flat = probs.view(*q.shape[:3], key.shape[2])
            grad_value = torch.matmul(flat.to(value.dtype).transpose(-1, -2), grad_out)
            grad_probs = torch.matmul(grad_out, value.transpose(-1, -2)).to(probs.dtype).view_as(probs)
            grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
            del probs, flat, grad_probs
            if mask is not None and mask.dtype == torch.bool:  # masked_fill passes no gradient to filled scores
                grad_scores.masked_fill_(~mask[:, :, None], 0.0)
            grad_scores = grad_scores.mul_(ctx.scale).to(q.dtype).view(*q.shape[:3], key.shape[2])
            grad_q = torch.matmul(grad_scores, key)
            grad_key = torch.matmul(grad_scores.transpose(-1, -2), q)
        return grad_q, grad_key, grad_value, None, None, None


class QueryBlock(NamedTuple):
    """``N`` rows of ``n`` queries, each against its own ``m`` keys, as columns of a flat layout."""

    query_cols: torch.Tensor  # [N, n]: the layout column of each query (padding repeats a real column)
    key_cols: torch.Tensor  # [N, m]: the layout column of each key
    mask: torch.Tensor  # [N, 1, n, m] bool, True = attend


class AttentionBlocks(NamedTuple):
    """Attention over a one-row layout of ``W`` columns as a few batched pieces
    (`posttrain.models.shared_prefix.build_tree_layout`): each :class:`QueryBlock` gathers its queries
    and keys from the layout's columns, and ``source_rows[c]`` is the row of the blocks' concatenated
    ``[sum N * n]`` outputs that column ``c`` takes. Built once per forward (it depends on the
    layout, not on the layer)."""

    blocks: tuple[QueryBlock, ...]
    source_rows: torch.Tensor  # [W]


def block_attention(module: nn.Module, query, key, value, layout: AttentionBlocks, **kwargs):
    """Attention over a one-row layout by blocks (:class:`AttentionBlocks`).

    query ``[1, Hq, W, d]``, key/value ``[1, Hkv, W, d]``. Each block's queries and keys are gathered
    from the layout's columns (``index_select``, whose backward is ``index_add``: a key read by many
    blocks, such as a shared prompt token, sums its gradients) and attended by :func:`posttrain_sdpa`'s
    rules with the block's mask. Returns ``[1, W, Hq, d]``.
    """
    q_heads, dim = query.shape[1], query.shape[3]

    def gather(x: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:  # [1, h, W, d] -> [N, h, n, d]
        by_col = x[0].transpose(0, 1)  # [W, h, d]
        return by_col.index_select(0, cols.reshape(-1)).view(*cols.shape, x.shape[1], dim).transpose(1, 2)

    outs = []
    for block in layout.blocks:
        keys, values = gather(key, block.key_cols), gather(value, block.key_cols)
        out = posttrain_sdpa(module, gather(query, block.query_cols), keys, values, block.mask, **kwargs)[0]
        outs.append(out.reshape(-1, q_heads, dim))  # [N * n, Hq, d]
    return torch.cat(outs).index_select(0, layout.source_rows)[None]


def _half_compute(query: torch.Tensor) -> bool:
    return query.dtype in (torch.bfloat16, torch.float16) or _autocast_dtype() in (torch.bfloat16, torch.float16)


def posttrain_sdpa(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                   scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """The ``posttrain_sdpa`` attention function (module docstring): ``([B, q, Hq, d], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    blocks = kwargs.pop(PREFIX_SLOTS_KWARG, None)  # AttentionBlocks of a shared-prompt layout
    if blocks is not None and query.shape[2] == key.shape[2]:
        return block_attention(module, query, key, value, blocks, dropout=dropout,
                               scaling=scaling, is_causal=is_causal, **kwargs), None
    batch, q_heads, q_len, _, _ = _grouped(query, key)
    plain = (query.device.type == "cpu" and q_heads % key.shape[1] == 0 and kwargs.get("softcap") is None
             and kwargs.get("position_bias") is None and kwargs.get("sliding_window") is None
             and not kwargs.get("output_attentions", False))
    if plain and q_len == 1:
        return single_query_attention(module, query, key, value, attention_mask, scaling), None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if plain and _half_compute(query) and batch * q_heads * q_len * key.shape[2] <= MAX_SCORE_ELEMENTS:
        return matmul_attention(module, query, key, value, attention_mask, scaling, dropout, causal), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _register() -> bool:
    if "ok" not in _state:
        try:
            from transformers import AttentionInterface
            from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: F401
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

            AttentionInterface.register(ATTN_NAME, posttrain_sdpa)
            AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
            _state["ok"] = True
        except (ImportError, AttributeError):
            _state["ok"] = False
    return _state["ok"]


def _recomputes_in_backward(model: nn.Module) -> bool:
    """Activation checkpointing with grad on: the backward re-runs the forward outside our block, and
    must pick the same attention function, so the switch is skipped."""
    return torch.is_grad_enabled() and any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


@contextlib.contextmanager
def fast_cpu_attention(model: nn.Module) -> Iterator[None]:
    """Within the block, a CPU model on ``sdpa`` attends with ``posttrain_sdpa`` (module docstring).

    Not with activation checkpointing while grad is on (the recomputation in backward happens outside).
    """
    config = getattr(model, "config", None)
    on_cpu = next(model.parameters(), torch.empty(0)).device.type == "cpu"
    if (not on_cpu or config is None or getattr(config, "_attn_implementation", None) != "sdpa"
            or _recomputes_in_backward(model) or not _register()):
        yield
        return
    try:
        config._attn_implementation = ATTN_NAME
    except (AttributeError, ValueError, KeyError):
        yield
        return
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
