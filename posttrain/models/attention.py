"""CPU attention for ``transformers`` models on ``sdpa``: faster bf16 forward/backward and decoding.

torch's CPU ``scaled_dot_product_attention`` kernel (flash, blocked) is slow in two cases that
dominate posttrain's CPU runs (SmolLM2-135M, 1 thread, ``[32, 9, 114, 64]`` per layer):

- bf16 (autocast) forward + backward: 134 ms per layer vs 67 ms for two matmuls and a softmax;
- a one-token query while decoding: ~3 ms per layer vs 0.5 ms (most of a decoding step).

``fast_cpu_attention(model)`` switches a model whose ``config._attn_implementation`` is ``sdpa``
to ``posttrain_sdpa`` for the duration of a ``with`` block (autograd keeps what the forward chose,
so the backward may run outside; not with activation checkpointing, whose recomputation in
backward must choose the same function). ``posttrain_sdpa`` uses transformers' sdpa mask builder and:

- one-token queries on CPU: :func:`single_query_attention` (grouped-query heads packed, no ``repeat_kv``);
- multi-token queries on CPU computed in bf16/fp16 (autocast or half inputs), when the score
  tensor is small (``batch * heads * q * kv <= MAX_SCORE_ELEMENTS``): :func:`matmul_attention`;
- everything else (fp32, CUDA, long sequences): transformers' own ``sdpa`` function;
- a shared-prompt layout (``posttrain.models.shared_prefix``, which passes ``posttrain_prefix_slots``
  through the backbone): :func:`prefix_slot_attention`, the prompt and each response slot attended
  separately (each piece by the rules above) instead of the dense ``[L, L]`` mask.

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

__all__ = ["ATTN_NAME", "MAX_SCORE_ELEMENTS", "PREFIX_SLOTS_KWARG", "fast_cpu_attention", "matmul_attention",
           "SlotSegments", "prefix_slot_attention", "single_query_attention", "single_query_probs",
           "slot_segments"]

ATTN_NAME = "posttrain_sdpa"
PREFIX_SLOTS_KWARG = "posttrain_prefix_slots"
"""Keyword a backbone passes through to its attention: the :class:`SlotSegments` of a shared-prompt layout."""
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


class SlotSegments(NamedTuple):
    """A shared-prompt layout ``[prompt (P) | slot 0 | slot 1 | ...]`` of ``G`` rows of ``L`` columns
    with ``k`` slots each, as :func:`prefix_slot_attention` reads it: built once per forward by
    :func:`slot_segments` (it depends on the layout only, not on the layer)."""

    prompt_len: int
    longest: int  # R': the longest slot (shorter ones padded to it)
    prompt_mask: torch.Tensor  # [G, 1, P, P] bool: the prompt's queries against the prompt
    slot_cols: torch.Tensor  # [G * k * R']: each slot query's row of a [G * L] view (padding clamped)
    slot_mask: torch.Tensor  # [G * k, 1, R', P + R'] bool: each slot's queries against [prompt | own slot]
    source_rows: torch.Tensor  # [G * L]: the row of the [G * (P + k R')] outputs that each column takes


def slot_segments(mask: torch.Tensor, prompt_len: int, slot_start: torch.Tensor, slot_len: torch.Tensor) -> SlotSegments:
    """The segments of a shared-prompt layout from its dense mask ``[G, 1, L, L]`` (bool, True = attend;
    read only at the pairs a segment can attend: prompt-prompt and slot-[prompt | own slot]) and each
    slot's first column and length ``[G, k]`` (0: no response)."""
    groups, k, width, p, device = mask.shape[0], slot_start.shape[1], mask.shape[-1], prompt_len, mask.device
    longest = max(1, int(slot_len.max()))
    steps = torch.arange(longest, device=device)
    cols = (slot_start[..., None] + steps).clamp(max=width - 1)  # [G, k, R']: each slot's columns (padded)
    rows_of = torch.arange(groups, device=device)[:, None, None]
    rows = mask[:, 0][rows_of, cols]  # [G, k, R', L]: each slot query's mask row
    own = rows.gather(-1, cols[:, :, None, :].expand(groups, k, longest, longest))  # [G, k, R', R']
    filled = steps < slot_len[..., None]  # [G, k, R']
    # a slot's padding keys stay hidden (their columns belong to a sibling or are clamped); every query sees itself
    own = own & filled[:, :, None, :] | torch.eye(longest, dtype=torch.bool, device=device)
    slot_mask = torch.cat([rows[..., :p], own], dim=-1).reshape(groups * k, 1, longest, p + longest)
    source = torch.zeros(groups, width, dtype=torch.long, device=device)  # columns after the last slot: column 0
    source[:, :p] = torch.arange(p, device=device)
    source[rows_of.expand_as(cols)[filled], cols[filled]] = (p + torch.arange(k * longest, device=device)).view(
        1, k, longest).expand(groups, k, longest)[filled]
    source = source + torch.arange(groups, device=device)[:, None] * (p + k * longest)
    # (group, column) pairs as rows of a [G * L, ...] view: index_select's backward is index_add,
    # where advanced indexing's (index_put with accumulation) is many times slower on CPU
    return SlotSegments(p, longest, mask[:, :, :p, :p], (rows_of * width + cols).view(-1), slot_mask, source.view(-1))


def prefix_slot_attention(module: nn.Module, query, key, value, segments: SlotSegments, **kwargs):
    """Attention over a shared-prompt layout by segments (:class:`SlotSegments`).

    query ``[G, Hq, L, d]``, key/value ``[G, Hkv, L, d]``. The prompt's queries attend to the prompt;
    the slots become ``G * k`` rows of ``R'`` queries (the longest slot; shorter ones padded) against
    their prompt's keys followed by their own (``P^2 + k R' (P + R')`` pairs instead of ``L^2``), each
    piece by :func:`posttrain_sdpa`'s rules. Backward sums each prompt key's gradient over its slots.
    Returns ``[G, L, Hq, d]``; columns after a row's last slot get the output of column 0 (they are
    never scored).
    """
    groups, q_heads, width, dim = query.shape
    p, longest = segments.prompt_len, segments.longest
    k = segments.slot_mask.shape[0] // groups
    head = posttrain_sdpa(module, query[:, :, :p], key[:, :, :p], value[:, :, :p], segments.prompt_mask,
                          **kwargs)[0]  # [G, P, Hq, d]

    def slots_of(x: torch.Tensor) -> torch.Tensor:  # [G, h, L, d] -> [G, k, R', h, d]
        by_col = x.transpose(1, 2).reshape(groups * width, x.shape[1], dim)
        return by_col.index_select(0, segments.slot_cols).view(groups, k, longest, x.shape[1], dim)

    def per_slot(x: torch.Tensor) -> torch.Tensor:  # [G, h, L, d] -> [G*k, h, P + R', d]: [prompt | slot]
        heads = x.shape[1]
        prompt = x.transpose(1, 2)[:, None, :p].expand(groups, k, p, heads, dim)
        both = torch.cat([prompt, slots_of(x)], dim=2)  # [G, k, P + R', h, d]
        return both.reshape(groups * k, p + longest, heads, dim).transpose(1, 2)

    q = slots_of(query).reshape(groups * k, longest, q_heads, dim).transpose(1, 2)
    tail = posttrain_sdpa(module, q, per_slot(key), per_slot(value), segments.slot_mask, **kwargs)[0]  # [G*k, R', Hq, d]
    source = torch.cat([head, tail.reshape(groups, k * longest, q_heads, dim)], dim=1)  # [G, P + k R', Hq, d]
    return source.reshape(-1, q_heads, dim).index_select(0, segments.source_rows).view(groups, width, q_heads, dim)


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

    segments = kwargs.pop(PREFIX_SLOTS_KWARG, None)  # SlotSegments of a shared-prompt layout
    if segments is not None and query.shape[2] == key.shape[2]:
        return prefix_slot_attention(module, query, key, value, segments, dropout=dropout,
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
