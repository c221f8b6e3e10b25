"""Shared-prompt forward (verl's ``actor.use_prefix_grouper``): each distinct prompt of a micro-batch
is encoded once, and all of its responses attend to that one copy.

GRPO, RLOO and their relatives sample ``n`` responses per prompt, so the plain forward encodes
every prompt ``n`` times. Here the rows of a micro-batch that share a prompt (same tokens, mask and
positions) become one sequence::

    [ prompt | response 0 | response 1 | ... ]      one row per distinct prompt

Each response fills a slot as long as its valid tokens (its right padding is not copied); prompts
with fewer responses, or shorter ones, are padded at the end of their row. A ``[G, 1, L, L]``
boolean mask lets prompt tokens attend causally to the prompt and a response token to the whole
prompt and causally to its own slot, never to a sibling's. Positions are the rows' own (each
response continues its prompt's positions), so every hidden state that predicts a response token
is the plain forward's, up to float rounding: the same math on fewer tokens (``P + sum of response
lengths`` per prompt instead of ``k * (P + R)``).

Attention: with posttrain's CPU attention active (``posttrain.models.attention``, an ``sdpa`` model
on CPU) the backbone is told where the slots are and attends by segments: the prompt causally to
itself, then every slot as a row of queries against ``[prompt | own slot]`` keys (``P^2 + k R'
(P + R')`` query-key pairs per prompt, ``R'`` the longest response). Other kernels get the dense
``[L, L]`` mask and pay ``L^2`` pairs. Either way :func:`build_layout` compares the grouped forward's
cost with the plain one and returns None (the caller runs the plain forward) where grouping would
cost more.

Measured (SmolLM2-135M shape, bf16 autocast, 8 prompts of 75 tokens x 4 responses of 32, one
forward + backward, 2-core CPU): 7.0 s plain, 3.6-4.0 s shared (dense mask, slots padded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["SharedPrefixLayout", "build_layout", "prompt_groups", "prompt_key", "shared_prefix_hidden_states"]

_FLOP_PER_PAIR_OVER_HIDDEN = 6
"""Cost model of one forward, in units of one attention pair: a token through the linear layers is
~24 H^2 FLOP (Llama-like: 4 H^2 attention projections, ~8 H^2 MLP, times 2), a query-key pair
~4 H (scores and weighted values), so one token costs ~6 H pairs."""


@dataclass
class SharedPrefixLayout:
    """The grouped forward of one micro-batch of ``B`` rows with ``G`` distinct prompts.

    input_ids, position_ids: ``[G, L]``; mask: ``[G, 1, L, L]`` bool (True = attend).
    group: ``[B]`` the layout row of each input row. predict_cols: ``[B, take]`` the layout columns
    whose hidden states predict response tokens ``0..take-1`` of each input row. prompt_len: ``P``;
    slot_start, slot_len: ``[G, k]`` first column and length of each response slot (0: no response),
    what segmented attention needs.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    group: torch.Tensor
    predict_cols: torch.Tensor
    prompt_len: int
    slot_start: torch.Tensor
    slot_len: torch.Tensor


def prompt_key(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> torch.Tensor:
    """``[B, P]`` prompt token ids of ``[B, P + R]`` rows, -1 at padding: rows with equal keys ask the
    same prompt."""
    prompt_len = input_ids.shape[1] - response_length
    return torch.where(attention_mask[:, :prompt_len].bool(), input_ids[:, :prompt_len], -1)


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  response_length: int) -> tuple[torch.Tensor, int]:
    """``(group [B], G)``: rows with identical prompt tokens, mask and positions share a group id."""
    prompt_len = input_ids.shape[1] - response_length
    valid = attention_mask[:, :prompt_len].bool()
    key = torch.cat([prompt_key(input_ids, attention_mask, response_length),
                     torch.where(valid, position_ids[:, :prompt_len], -1)], dim=1)
    uniq, group = torch.unique(key, dim=0, return_inverse=True)
    return group, uniq.shape[0]


def _slots(group: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot [B], first_row [G])``: each row's rank among its group's rows (in row order) and each
    group's first row."""
    rows = group.shape[0]
    order = torch.sort(group, stable=True).indices
    counts = torch.bincount(group, minlength=num_groups)
    start = counts.cumsum(0) - counts
    slot = torch.empty_like(group)
    slot[order] = torch.arange(rows, device=group.device) - start[group[order]]
    return slot, order[start]


def build_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 response_length: int, hidden_size: int, segmented: bool = False) -> SharedPrefixLayout | None:
    """The grouped layout of ``[B, P + R]`` rows (prompt left-padded, response right-padded), or None
    when it would not be cheaper than the plain ``[B, P + R]`` forward (see the module docstring).
    ``segmented``: attention will run by segments (prompt, then each slot) instead of over the dense mask."""
    rows, seq_len = input_ids.shape
    prompt_len = seq_len - response_length
    group, num_groups = prompt_groups(input_ids, attention_mask, position_ids, response_length)
    slot, first = _slots(group, num_groups)
    per_group = int(slot.max()) + 1  # rows of the largest group
    if per_group == 1:  # no prompt asked twice: nothing to share
        return None
    device = input_ids.device
    steps = torch.arange(response_length, device=device)
    resp_valid = attention_mask[:, prompt_len:].bool()
    length = torch.where(resp_valid, steps + 1, 0).amax(1)  # [B]: up to the last valid token (no right padding)
    slot_len = torch.zeros(num_groups, per_group, dtype=torch.long, device=device)
    slot_len[group, slot] = length
    slot_start = prompt_len + slot_len.cumsum(1) - slot_len  # [G, k]
    width = prompt_len + int(slot_len.sum(1).max())
    longest = max(1, int(length.max()))
    pairs = (prompt_len ** 2 + per_group * longest * (prompt_len + longest)) if segmented else width ** 2
    shared = num_groups * (width * _FLOP_PER_PAIR_OVER_HIDDEN * hidden_size + pairs)
    plain = rows * seq_len * (_FLOP_PER_PAIR_OVER_HIDDEN * hidden_size + seq_len)
    if shared >= plain:
        return None
    resp_cols = slot_start[group, slot][:, None] + steps  # [B, R]; valid where steps < length
    copied = steps < length[:, None]
    ids = input_ids.new_zeros(num_groups, width)
    pos = position_ids.new_zeros(num_groups, width)
    valid = torch.zeros(num_groups, width, dtype=torch.bool, device=device)
    segment = torch.full((num_groups, width), -2, dtype=torch.long, device=device)  # -2: after the last slot
    ids[:, :prompt_len] = input_ids[first, :prompt_len]
    pos[:, :prompt_len] = position_ids[first, :prompt_len]
    valid[:, :prompt_len] = attention_mask[first, :prompt_len].bool()
    segment[:, :prompt_len] = -1
    at = (group[:, None].expand_as(resp_cols)[copied], resp_cols[copied])
    ids[at] = input_ids[:, prompt_len:][copied]
    pos[at] = position_ids[:, prompt_len:][copied]
    valid[at] = resp_valid[copied]
    segment[at] = slot[:, None].expand_as(resp_cols)[copied]
    # states past a row's last valid token are never scored (callers keep valid tokens only): any column will do
    predict = torch.cat([torch.full((rows, 1), prompt_len - 1, device=device), resp_cols[:, :-1]], dim=1)
    return SharedPrefixLayout(ids, pos, _layout_mask(valid, segment), group, predict.clamp(max=width - 1),
                              prompt_len, slot_start, slot_len)


def _layout_mask(valid: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """``[G, 1, L, L]`` bool from the layout's valid columns and segments ``[G, L]`` (-1 prompt, ``j`` slot
    ``j``): prompt tokens attend causally to the prompt, a response token to the prompt and causally
    to its own slot."""
    width = valid.shape[1]
    cols = torch.arange(width, device=valid.device)
    same_or_prompt = (segment[:, :, None] == segment[:, None, :]) | (segment[:, None, :] == -1)  # [G, q, k]
    attend = same_or_prompt & (cols[:, None] >= cols[None, :])
    # every query keeps its own position (a padding query with nothing to attend to would give NaN
    # under sdpa, and NaN times a zero gradient is still NaN in backward); valid queries never see padding
    mask = (attend & valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=valid.device)[None]
    return mask[:, None]


def _mask_form(backbone: nn.Module) -> str | None:
    """How the backbone's attention takes a dense mask: ``bool`` for sdpa (and posttrain's CPU sdpa),
    ``additive`` for eager (which adds the mask to the scores, so a boolean one would count as 0/1);
    None for kernels that take no dense mask (flash attention): the caller then runs the plain forward."""
    from posttrain.models.attention import ATTN_NAME

    impl = getattr(backbone.config, "_attn_implementation", None)
    return "bool" if impl in ("sdpa", ATTN_NAME) else "additive" if impl == "eager" else None


def shared_prefix_hidden_states(backbone: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                position_ids: torch.Tensor, response_length: int) -> torch.Tensor | None:
    """Hidden states ``[B, R, H]`` that predict the ``R`` response tokens of ``[B, P + R]`` rows
    (``[:, j]`` predicts response token ``j``), computed on the grouped layout; None when the plain
    forward is cheaper or the attention kernel takes no dense mask. Callers pass the column window
    they would run (no all-padding columns)."""
    from posttrain.models.attention import ATTN_NAME, PREFIX_SLOTS_KWARG, slot_segments

    form = _mask_form(backbone)  # checked first: no layout is built for a kernel that cannot take it
    if form is None:
        return None
    # posttrain's attention reads the layout's segments from a keyword the backbone passes through to it
    segmented = getattr(backbone.config, "_attn_implementation", None) == ATTN_NAME
    layout = build_layout(input_ids, attention_mask, position_ids, response_length,
                          int(getattr(backbone.config, "hidden_size", 0) or 0), segmented)
    if layout is None:
        return None
    mask = layout.mask
    if form == "additive":
        mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(
            ~mask, torch.finfo(torch.float32).min)
    # segments read the layout (mask, slots), not the layer: built once here rather than in every layer
    extra = {PREFIX_SLOTS_KWARG: slot_segments(layout.mask, layout.prompt_len, layout.slot_start, layout.slot_len)
             } if segmented else {}
    out = backbone(input_ids=layout.input_ids, attention_mask=mask, position_ids=layout.position_ids, use_cache=False,
                   **extra)
    return out.last_hidden_state[layout.group[:, None], layout.predict_cols]
