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
  tensor is small (``batch * heads * q * kv <= MAX_SCORE_ELEMENTS``): :func:`matmul_attention`;
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
float32 scores per layer, 32 MiB of bf16 probabilities kept for backward); longer inputs use the
memory-efficient sdpa kernel."""

_state: dict[str, bool] = {}


def _grouped(query: torch.Tensor, key: torch.Tensor) -> tuple[int, int, int, int, int]:
    batch, q_heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    return batch, q_heads, q_len, dim, q_heads // kv_heads


def _apply_mask(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """scores ``[B, Hkv, g, q, L]`` float32; mask ``[B|1, 1, q, L]`` bool (True = attend) or additive."""
    if mask is None:
        return scores
    mask = mask[:, :, None]  # [B, 1, 1, q, L]
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    return scores + mask.float()


def single_query_probs(scores: torch.Tensor, mask: torch.Tensor | None, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Attention probabilities of one query token: scores ``[B, Hkv, g, L]`` scaled and softmaxed in
    float32 at least, mask ``[B|1, 1, 1, L]`` (bool, True = attend, or additive) applied as
    :func:`_apply_mask` does; returned in ``dtype``."""
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    scores = _apply_mask(scores[:, :, :, None], mask)[:, :, :, 0]
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
    causal, the queries being the last ``q`` positions). Returns ``[B, q, Hq, d]``.
    """
    batch, q_heads, q_len, dim, group = _grouped(query, key)
    kv_heads, kv_len = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else dim ** -0.5
    q = query.reshape(batch, kv_heads, group * q_len, dim)
    scores = (torch.matmul(q, key.transpose(-1, -2)).float() * scale).view(batch, kv_heads, group, q_len, kv_len)
    if attention_mask is None and is_causal and q_len > 1:
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)[None, None]
    scores = _apply_mask(scores, attention_mask)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    if dropout > 0.0 and module.training:
        probs = nn.functional.dropout(probs, p=dropout)
    out = torch.matmul(probs.view(batch, kv_heads, group * q_len, kv_len), value)
    return out.view(batch, kv_heads, group, q_len, dim).permute(0, 3, 1, 2, 4).reshape(batch, q_len, q_heads, dim)


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
    if query.dtype in (torch.bfloat16, torch.float16):
        return True
    try:
        return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in (torch.bfloat16, torch.float16)
    except TypeError:  # torch < 2.4
        return torch.is_autocast_cpu_enabled() and torch.get_autocast_cpu_dtype() in (torch.bfloat16, torch.float16)


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
