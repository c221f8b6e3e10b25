"""Shared-prompt forward (verl's ``actor.use_prefix_grouper``): each distinct prompt of a micro-batch
is encoded once, and all of its responses attend to that one copy.

GRPO, RLOO and their relatives sample ``n`` responses per prompt, so the plain forward encodes
every prompt ``n`` times; and the prompts of a batch often begin alike (a system prompt, a chat
template, a worked example), which the plain forward encodes once per row. Two layouts remove the
copies; both keep each token's own position, so every hidden state that predicts a response token
is the plain forward's, up to float rounding (the same math on fewer tokens).

With posttrain's CPU attention active (``posttrain.models.attention``, an ``sdpa`` model on CPU),
:func:`build_tree_layout` puts the micro-batch in one row without padding::

    [ shared beginning | own prompt 0 | response | response | ... | own prompt 1 | response | ... ]

and attends by blocks (:class:`~posttrain.models.attention.AttentionBlocks`): the beginning every
prompt shares causally to itself; each prompt's own tokens to the beginning and causally to
themselves; each response to the beginning, its prompt's own tokens and causally to itself, never
to a sibling's. The built-in run's 8 prompts share 63 of their ~76 tokens, so a micro-batch of 4
prompts x 4 responses encodes ``63 + 4 (13 + 4 R)`` tokens instead of ``16 (76 + R)``.

Other kernels (eager) get :func:`build_layout`: one row per distinct prompt,
``[ prompt | response 0 | response 1 | ... ]`` (responses packed to their valid tokens, rows padded
at the end), and a dense ``[G, 1, L, L]`` boolean mask (``L^2`` pairs per row).

Either builder compares its forward's cost with the plain one and returns None (the caller runs the
plain forward) where it would cost more.

One row per prompt roughly halves a forward + backward of the built-in run's shape; measured by
hand and in the trainer with ``benchmarks/bench_ab.py --lever prefix`` / ``--lever beginning``
(figures and machines in benchmarks/README.md, "Shared prompts").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

if TYPE_CHECKING:
    from posttrain.models.attention import AttentionBlocks

__all__ = ["SharedPrefixLayout", "TreeLayout", "build_layout", "build_tree_layout", "prompt_groups", "prompt_key",
           "shared_beginning", "shared_prefix_hidden_states", "take_columns"]

_FLOP_PER_PAIR_OVER_HIDDEN = 6
"""Cost model of one forward, in units of one attention pair: a token through the linear layers is
~24 H^2 FLOP (Llama-like: 4 H^2 attention projections, ~8 H^2 MLP, times 2), a query-key pair
~4 H (scores and weighted values), so one token costs ~6 H pairs."""


@dataclass
class SharedPrefixLayout:
    """The one-row-per-prompt forward of ``B`` rows with ``G`` distinct prompts (dense mask).

    input_ids, position_ids: ``[G, L]``; mask: ``[G, 1, L, L]`` bool (True = attend).
    group: ``[B]`` the layout row of each input row. predict_cols: ``[B, take]`` the layout columns
    whose hidden states predict response tokens ``0..take-1`` of each input row.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    group: torch.Tensor
    predict_cols: torch.Tensor


@dataclass
class TreeLayout:
    """The one-row forward of a micro-batch (module docstring): input_ids, position_ids ``[1, W]``;
    predict_cols ``[B, take]`` the columns whose hidden states predict response tokens ``0..take-1``
    of each input row; blocks: how attention reads the row; shared_len: the shared beginning's tokens."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    predict_cols: torch.Tensor
    blocks: AttentionBlocks
    shared_len: int


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


def _response_lengths(attention_mask: torch.Tensor, response_length: int) -> torch.Tensor:
    """``[B]``: each row's response up to its last valid token (its right padding dropped)."""
    steps = torch.arange(response_length, device=attention_mask.device)
    return torch.where(attention_mask[:, -response_length:].bool(), steps + 1, 0).amax(1)


def build_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 response_length: int, hidden_size: int) -> SharedPrefixLayout | None:
    """The one-row-per-prompt layout of ``[B, P + R]`` rows (prompt left-padded, response
    right-padded) with its dense mask, or None when it would not be cheaper than the plain
    ``[B, P + R]`` forward (see the module docstring)."""
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
    length = _response_lengths(attention_mask, response_length)
    slot_len = torch.zeros(num_groups, per_group, dtype=torch.long, device=device)
    slot_len[group, slot] = length
    slot_start = prompt_len + slot_len.cumsum(1) - slot_len  # [G, k]
    width = prompt_len + int(slot_len.sum(1).max())
    shared = num_groups * width * (width + _FLOP_PER_PAIR_OVER_HIDDEN * hidden_size)
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
    return SharedPrefixLayout(ids, pos, _layout_mask(valid, segment), group, predict.clamp(max=width - 1))


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


def shared_beginning(tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor) -> int:
    """How many first tokens (and their positions) every prompt has in common, ``[G, P]`` valid tokens
    first; at most the shortest prompt's length minus one, so every prompt keeps a token of its own
    (the one that predicts its first response token). The ``hf`` engine's prefill shares the same
    beginning (`posttrain.rollout.hf._shared_prefix_length`)."""
    most = int(lengths.min()) - 1
    if tokens.shape[0] < 2 or most <= 0:
        return 0
    same = ((tokens[:, :most] == tokens[:1, :most]) & (positions[:, :most] == positions[:1, :most])).all(0)
    return int(same.long().cumprod(0).sum())


class _Placement(NamedTuple):
    """Where a micro-batch's tokens sit in the one-row layout: ``S`` shared columns first, then per
    prompt ``g`` its own tokens (``own_cols[g, :own[g]]``; the rest of the row of ``own_cols`` repeats
    its last, ``own_ok`` False) and each input row's response (``resp_cols[b, :length[b]]``, likewise
    padded, ``filled`` False)."""

    shared: int
    width: int
    group: torch.Tensor  # [B]: each input row's prompt
    own_cols: torch.Tensor  # [G, own_max]
    own_ok: torch.Tensor  # [G, own_max]
    resp_cols: torch.Tensor  # [B, R']
    filled: torch.Tensor  # [B, R']


def build_tree_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                      response_length: int, hidden_size: int) -> TreeLayout | None:
    """The one-row layout of ``[B, P + R]`` rows (prompt left-padded, response right-padded) and the
    attention blocks that read it (module docstring), or None when nothing is shared or it would not
    be cheaper than the plain ``[B, P + R]`` forward."""
    rows, seq_len = input_ids.shape
    prompt_len = seq_len - response_length
    group, num_groups = prompt_groups(input_ids, attention_mask, position_ids, response_length)
    slot, first = _slots(group, num_groups)
    valid = attention_mask[first, :prompt_len].bool()  # [G, P]
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices  # each prompt's valid columns first
    tokens = input_ids[first, :prompt_len].gather(1, order)
    positions = position_ids[first, :prompt_len].gather(1, order)
    lengths = valid.sum(1)
    shared = shared_beginning(tokens, positions, lengths)
    if num_groups == rows and shared == 0:
        return None  # every prompt once already and no beginning in common: nothing to share
    place = _place(group, slot, lengths - shared, _response_lengths(attention_mask, response_length), shared)
    own_max, longest = place.own_cols.shape[1], place.resp_cols.shape[1]
    pairs = shared ** 2 + num_groups * own_max * (shared + own_max) + rows * longest * (shared + own_max + longest)
    if place.width * _FLOP_PER_PAIR_OVER_HIDDEN * hidden_size + pairs >= rows * seq_len * (
            _FLOP_PER_PAIR_OVER_HIDDEN * hidden_size + seq_len):
        return None
    # the row's token ids and positions: the shared beginning, each prompt's own tokens, the responses
    ids, pos = input_ids.new_zeros(place.width), position_ids.new_zeros(place.width)
    ids[:shared], pos[:shared] = tokens[0, :shared], positions[0, :shared]
    from_prompt = (shared + torch.arange(own_max, device=ids.device)).clamp(max=prompt_len - 1).expand(num_groups, -1)
    at, ok = place.own_cols[place.own_ok], place.own_ok
    ids[at], pos[at] = tokens.gather(1, from_prompt)[ok], positions.gather(1, from_prompt)[ok]
    at, ok = place.resp_cols[place.filled], place.filled
    ids[at] = input_ids[:, prompt_len:prompt_len + longest][ok]
    pos[at] = position_ids[:, prompt_len:prompt_len + longest][ok]
    # hidden states past a row's last valid token are never scored (callers keep valid tokens only)
    predict = torch.cat([place.own_cols[group, -1:], place.resp_cols[:, :1] + torch.arange(
        response_length - 1, device=ids.device)], dim=1).clamp(max=place.width - 1)
    return TreeLayout(ids[None], pos[None], predict, _attention_blocks(place), shared)


def _place(group: torch.Tensor, slot: torch.Tensor, own: torch.Tensor, length: torch.Tensor, shared: int) -> _Placement:
    """The columns of the one-row layout: prompt ``g`` has ``own[g]`` tokens after the shared ``S``;
    input row ``b`` is response ``slot[b]`` of prompt ``group[b]``, ``length[b]`` tokens long."""
    device = group.device
    slot_len = torch.zeros(own.shape[0], int(slot.max()) + 1, dtype=torch.long, device=device)
    slot_len[group, slot] = length
    size = own + slot_len.sum(1)  # [G]: each prompt's columns (own tokens, then its responses)
    group_start = shared + size.cumsum(0) - size
    steps_own = torch.arange(int(own.max()), device=device)
    own_cols = group_start[:, None] + torch.minimum(steps_own, own[:, None] - 1)
    row_start = group_start[group] + own[group] + (slot_len.cumsum(1) - slot_len)[group, slot]  # [B]
    steps = torch.arange(max(1, int(length.max())), device=device)
    resp_cols = row_start[:, None] + torch.minimum(steps, (length[:, None] - 1).clamp(min=0))
    resp_cols = torch.where(length[:, None] > 0, resp_cols, row_start[:, None] - 1)  # no response: any real column
    return _Placement(shared, shared + int(size.sum()), group, own_cols, steps_own < own[:, None], resp_cols,
                      steps < length[:, None])


def _attention_blocks(place: _Placement) -> AttentionBlocks:
    """The blocks that read the one-row layout (module docstring) and the block row each column's
    output comes from."""
    from posttrain.models.attention import AttentionBlocks, QueryBlock

    shared, device = place.shared, place.own_cols.device
    (groups, own_max), (rows, longest) = place.own_cols.shape, place.resp_cols.shape
    beginning = torch.arange(shared, device=device)
    blocks, source = [], torch.empty(place.width, dtype=torch.long, device=device)
    if shared:  # the beginning, causally to itself
        causal = torch.ones(shared, shared, dtype=torch.bool, device=device).tril()
        blocks.append(QueryBlock(beginning[None], beginning[None], causal[None, None]))
        source[:shared] = beginning
    # each prompt's own tokens: to the beginning, causally to themselves
    own_keys = torch.cat([beginning.expand(groups, shared), place.own_cols], dim=1)  # [G, S + own_max]
    causal = torch.ones(own_max, own_max, dtype=torch.bool, device=device).tril()
    own_mask = torch.cat([torch.ones(groups, own_max, shared, dtype=torch.bool, device=device),
                          causal & place.own_ok[:, None, :]], dim=2)
    blocks.append(QueryBlock(place.own_cols, own_keys, own_mask[:, None]))
    source[place.own_cols[place.own_ok]] = (shared + torch.arange(groups * own_max, device=device))[
        place.own_ok.flatten()]
    # each response: to its whole prompt, causally to itself (a padding query sees itself: no empty row)
    resp_keys = torch.cat([own_keys[place.group], place.resp_cols], dim=1)  # [B, S + own_max + R']
    causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
    itself = torch.eye(longest, dtype=torch.bool, device=device)
    resp_mask = torch.cat([own_mask[place.group][:, -1:].expand(rows, longest, shared + own_max),
                           causal & (place.filled[:, None, :] | itself)], dim=2)
    blocks.append(QueryBlock(place.resp_cols, resp_keys, resp_mask[:, None]))
    offset = shared + groups * own_max
    source[place.resp_cols[place.filled]] = (offset + torch.arange(rows * longest, device=device))[
        place.filled.flatten()]
    return AttentionBlocks(tuple(blocks), source)


def _mask_form(backbone: nn.Module) -> str | None:
    """How the backbone's attention takes a dense mask: ``bool`` for sdpa (and posttrain's CPU sdpa),
    ``additive`` for eager (which adds the mask to the scores, so a boolean one would count as 0/1);
    None for kernels that take no dense mask (flash attention): the caller then runs the plain forward."""
    from posttrain.models.attention import ATTN_NAME

    impl = getattr(backbone.config, "_attn_implementation", None)
    return "bool" if impl in ("sdpa", ATTN_NAME) else "additive" if impl == "eager" else None


def take_columns(hidden: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``hidden[cols]`` for ``[W, H]`` states and an index ``[B, T]`` that repeats columns (the prompt's last
    column predicts every response's first token), with a gradient that is the same on every run.

    Advanced indexing's backward on CPU sums a repeated column's gradients in parallel, in whatever order
    the threads reach it: the last bits vary from run to run, and one seed's training runs diverge after a
    few steps. ``index_select``'s backward sums them in index order."""
    return hidden.index_select(0, cols.flatten()).view(*cols.shape, hidden.shape[-1])


def shared_prefix_hidden_states(backbone: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                position_ids: torch.Tensor, response_length: int) -> torch.Tensor | None:
    """Hidden states ``[B, R, H]`` that predict the ``R`` response tokens of ``[B, P + R]`` rows
    (``[:, j]`` predicts response token ``j``), computed on a shared layout; None when the plain
    forward is cheaper or the attention kernel takes no dense mask. Callers pass the column window
    they would run (no all-padding columns)."""
    from posttrain.models.attention import ATTN_NAME, PREFIX_SLOTS_KWARG

    hidden_size = int(getattr(backbone.config, "hidden_size", 0) or 0)
    if getattr(backbone.config, "_attn_implementation", None) == ATTN_NAME:
        tree = build_tree_layout(input_ids, attention_mask, position_ids, response_length, hidden_size)
        if tree is None:
            return None
        # posttrain's attention reads the blocks from a keyword the backbone passes through to it; the
        # mask transformers builds from the positions is not read
        out = backbone(input_ids=tree.input_ids, position_ids=tree.position_ids, attention_mask=None,
                       use_cache=False, **{PREFIX_SLOTS_KWARG: tree.blocks})
        return take_columns(out.last_hidden_state[0], tree.predict_cols)
    form = _mask_form(backbone)  # checked first: no layout is built for a kernel that cannot take it
    if form is None:
        return None
    layout = build_layout(input_ids, attention_mask, position_ids, response_length, hidden_size)
    if layout is None:
        return None
    mask = layout.mask
    if form == "additive":
        mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(
            ~mask, torch.finfo(torch.float32).min)
    out = backbone(input_ids=layout.input_ids, attention_mask=mask, position_ids=layout.position_ids, use_cache=False)
    hidden = out.last_hidden_state  # [G, W, H]: row g's column c is flat row g * W + c
    return take_columns(hidden.flatten(0, 1), layout.group[:, None] * hidden.shape[1] + layout.predict_cols)
