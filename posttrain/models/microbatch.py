"""Split a batch into mini-batches (`mini_batch_indices`) and those into micro-batches by rows or by a token
budget (verl's dynamic batch size): the one home of batch splitting, for the updates and the scoring passes.

Under FSDP every forward and backward is a collective (all-gathers, reduce-scatters), so every
rank must run the same number of micro-batches; the splits here depend on each rank's own rows
(lengths, token budgets). :func:`equal_micro_batch_count` makes the counts agree.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import torch
import torch.distributed as dist

from posttrain.checkpoint.ranks import is_sharded  # re-exported: a sharded forward is a collective
from posttrain.models.shared_prefix import prompt_key

__all__ = ["split_rows", "split_by_tokens", "micro_batch_indices", "split_for_padding", "forward_micro_batches",
           "shared_prefix_by_tokens", "MicroBatch", "equal_micro_batch_count", "is_sharded", "zero_loss_weight",
           "mini_batch_indices", "micro_batches", "select_rows"]

MIN_PIECE_TOKENS = 1024
"""``split_for_padding`` keeps at least this many valid tokens per piece (smaller matmuls lose speed)."""
PER_PIECE_COST = 0.03
"""Extra cost of one more forward call, as a fraction of the group's padded tokens."""


def split_rows(num_rows: int, micro_batch_size: int) -> list[torch.Tensor]:
    """``[0..num_rows)`` in consecutive groups of ``micro_batch_size`` (the last may be shorter)."""
    if micro_batch_size is None or micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    return list(torch.arange(num_rows).split(micro_batch_size))


def split_by_tokens(attention_mask: torch.Tensor, max_token_len: int) -> list[torch.Tensor]:
    """Groups of row indices whose padded cost ``rows * longest row`` stays within ``max_token_len``.

    attention_mask: ``[N, S]``. Rows are sorted longest first and packed greedily, so rows of
    similar length share a micro-batch; a row longer than the budget gets a micro-batch alone.
    Callers that need the original order scatter results back with the returned indices.
    """
    lengths = attention_mask.sum(-1).tolist()
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    longest = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * max(longest, lengths[i]) <= max_token_len:
            groups[-1].append(i)
            longest = max(longest, lengths[i])
        else:
            groups.append([i])
            longest = lengths[i]
    return [torch.tensor(g, dtype=torch.long) for g in groups]


def micro_batch_indices(
    attention_mask: torch.Tensor,
    micro_batch_size: int | None,
    use_dynamic_bsz: bool = False,
    max_token_len: int | None = None,
    sort_by_length: bool = False,
) -> list[torch.Tensor]:
    """Row-index groups: by tokens when ``use_dynamic_bsz`` else by ``micro_batch_size`` rows
    (consecutive rows, or with ``sort_by_length`` rows of similar length, longest first)."""
    if use_dynamic_bsz:
        if not max_token_len:
            raise ValueError("use_dynamic_bsz needs a positive max_token_len")
        return split_by_tokens(attention_mask, max_token_len)
    size = micro_batch_size or attention_mask.shape[0]
    if not sort_by_length:
        return split_rows(attention_mask.shape[0], size)
    if size <= 0:
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    order = torch.sort(attention_mask.sum(-1).cpu(), descending=True, stable=True).indices
    return list(order.split(size))


def _padded_tokens(first: torch.Tensor, last: torch.Tensor) -> int:
    """Tokens a forward over these rows computes: rows x (columns from the earliest start to the latest end)."""
    return int(first.numel() * (int(last.max()) - int(first.min()) + 1)) if first.numel() else 0


def split_for_padding(attention_mask: torch.Tensor, groups: list[torch.Tensor],
                      min_tokens: int = MIN_PIECE_TOKENS) -> list[torch.Tensor]:
    """Split each group of row indices into 1-4 pieces of similar-length rows when that computes
    fewer padded tokens (after a ``PER_PIECE_COST`` charge per extra call), keeping at least
    ``min_tokens`` valid tokens per piece.

    A forward computes every column between a group's earliest first token and latest last
    token for every row (log-probs drop only columns that are padding in all rows), so rows that
    ended early pay for the longest one. Results do not depend on the split (micro-batch losses
    are normalised by mini-batch totals); only the amount of padding computed does.
    """
    mask = attention_mask.bool().cpu()
    cols = torch.arange(mask.shape[1])
    first = torch.where(mask, cols, mask.shape[1]).min(-1).values
    last = torch.where(mask, cols, -1).max(-1).values
    length = mask.sum(-1)
    out: list[torch.Tensor] = []
    for group in groups:
        g = group.cpu()
        base = _padded_tokens(first[g], last[g])
        best, best_cost = [group], float(base)
        order = g[torch.sort(length[g], descending=True, stable=True).indices]
        for k in (2, 3, 4):
            pieces = [p for p in order.tensor_split(k) if p.numel()]
            if len(pieces) < k or min(int(length[p].sum()) for p in pieces) < min_tokens:
                break
            cost = sum(_padded_tokens(first[p], last[p]) for p in pieces) + PER_PIECE_COST * base * (k - 1)
            if cost < best_cost:
                best, best_cost = [p.to(group.device) for p in pieces], cost
        out.extend(best)
    return out


def forward_micro_batches(attention_mask: torch.Tensor, micro_batch_size: int | None, use_dynamic_bsz: bool = False,
                          max_token_len: int | None = None, prompts: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Row-index groups for the forwards of a batch: rows of similar length together, pieces split
    where that computes less padding (:func:`split_for_padding`).

    ``prompts`` (``[N, P]`` ids, -1 at padding) asks for rows of one prompt to share a micro-batch
    (the shared-prefix forward encodes each distinct prompt once per micro-batch): whole prompts are
    packed into micro-batches of at most ``micro_batch_size`` rows, a prompt with more rows than that
    split; with ``use_dynamic_bsz``, of at most ``max_token_len`` tokens as that forward computes them
    (`shared_prefix_by_tokens`). Exact either way: the losses are normalised by mini-batch totals.
    """
    if prompts is not None and use_dynamic_bsz:
        return shared_prefix_by_tokens(attention_mask, prompts, max_token_len)
    if prompts is None:
        groups = micro_batch_indices(attention_mask, micro_batch_size, use_dynamic_bsz, max_token_len,
                                     sort_by_length=True)
        return split_for_padding(attention_mask, groups)
    size = micro_batch_size or attention_mask.shape[0]
    if size <= 0:
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    out: list[list[int]] = [[]]
    for rows in _rows_by_prompt(prompts):
        rows = rows.tolist()
        if len(out[-1]) + len(rows) > size and out[-1]:
            out.append([])
        while len(rows) > size:  # one prompt with more rows than a micro-batch holds
            out[-1], rows = rows[:size], rows[size:]
            out.append([])
        out[-1].extend(rows)
    return [torch.tensor(rows, dtype=torch.long) for rows in out if rows]


def _rows_by_prompt(prompts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Row indices of each distinct prompt (``[N, P]`` ids, -1 at padding), in the order of the sorted prompts."""
    _, group = torch.unique(prompts.cpu(), dim=0, return_inverse=True)
    return torch.sort(group, stable=True).indices.split(torch.bincount(group).tolist())


def shared_prefix_by_tokens(attention_mask: torch.Tensor, prompts: torch.Tensor,
                            max_token_len: int | None) -> list[torch.Tensor]:
    """Row-index groups of whole prompts whose shared-prefix forward computes at most ``max_token_len`` tokens:
    each distinct prompt once, and every row's response as long as the group's longest response (its block
    is padded to that). Prompts with the longest responses come first, so responses of similar length share
    a group; a prompt whose rows do not fit in one group is split into groups of as many rows as fit (at
    least one). ``attention_mask`` is ``[N, P + R]``, ``prompts`` ``[N, P]``."""
    if not max_token_len or max_token_len <= 0:
        raise ValueError(f"use_dynamic_bsz needs a positive max_token_len, got {max_token_len!r}")
    mask = attention_mask.bool().cpu()
    prompt_width = prompts.shape[1]
    prompt_tokens = mask[:, :prompt_width].sum(-1).tolist()
    response_tokens = mask[:, prompt_width:].sum(-1)
    by_prompt = sorted(_rows_by_prompt(prompts), key=lambda rows: -int(response_tokens[rows].max()))
    out: list[list[int]] = []
    used = longest = 0  # the open group's prompt tokens, and its longest response (the first prompt's)
    for rows in by_prompt:
        rows = rows[torch.sort(response_tokens[rows], descending=True, stable=True).indices].tolist()
        prompt = prompt_tokens[rows[0]]
        if out and used + prompt + (len(out[-1]) + len(rows)) * longest <= max_token_len:
            out[-1].extend(rows)  # the whole prompt fits beside the open group's
            used += prompt
            continue
        longest = max(1, int(response_tokens[rows[0]]))
        fit = max(1, (max_token_len - prompt) // longest)  # rows of this prompt per group
        for start in range(0, len(rows), fit):
            out.append(rows[start:start + fit])
        used = prompt
    return [torch.tensor(rows, dtype=torch.long) for rows in out]


class MicroBatch(NamedTuple):
    """One entry of :func:`equal_micro_batch_count`.

    rows: row indices (as the groups given).
    padding: True for a stand-in run only so this rank joins the collectives of the others'
        extra micro-batch: drop its outputs, and give its loss zero weight (:func:`zero_loss_weight`).
    """

    rows: torch.Tensor
    padding: bool


def _max_over_ranks(count: int, group: dist.ProcessGroup | None) -> int:
    """``count`` all-reduced with MAX over ``group`` (itself without an initialised process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return count
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"  # "cpu:gloo,cuda:nccl" takes CPU tensors
    t = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def _split_largest(groups: list[torch.Tensor]) -> bool:
    """Halve the group with the most rows in place (rows keep their order, so similar lengths stay
    together); False when every group has one row."""
    sizes = [g.numel() for g in groups]
    i = max(range(len(groups)), key=sizes.__getitem__, default=None)
    if i is None or sizes[i] < 2:
        return False
    groups[i:i + 1] = list(groups[i].tensor_split(2))
    return True


def equal_micro_batch_count(groups: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> list[MicroBatch]:
    """The same number of micro-batches on every rank of ``group`` (default: the world).

    A collective (one all-reduce MAX of the count) when ``torch.distributed`` is initialised with
    more than one rank; call it on every rank, with this rank's ``groups``. Ranks below the
    agreed count split their largest groups in halves; a rank with fewer rows than the count
    appends padding entries (its first row again, ``padding=True``; empty ``rows`` when the rank
    has no rows at all). Results do not change: micro-batch losses are normalised by mini-batch
    totals, and padding entries carry zero loss weight.
    """
    groups = [g for g in groups if g.numel()]
    target = _max_over_ranks(len(groups), group)
    while len(groups) < target and _split_largest(groups):
        pass
    out = [MicroBatch(g, False) for g in groups]
    stand_in = groups[0][:1] if groups else torch.zeros(0, dtype=torch.long)
    out += [MicroBatch(stand_in, True) for _ in range(target - len(out))]
    return out


def zero_loss_weight(micro_batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of a padding micro-batch whose ``response_mask`` is all zeros.

    posttrain's losses sum ``loss * mask`` (NaN-safe) over the mask and divide by mini-batch
    totals computed before, so this micro-batch adds exactly 0 to the loss, the gradient and the
    summed metrics, while its forward and backward still run every FSDP collective.
    """
    if "response_mask" not in micro_batch:
        raise KeyError("zero_loss_weight needs 'response_mask' in the micro-batch (the loss mask)")
    out = dict(micro_batch)
    out["response_mask"] = torch.zeros_like(micro_batch["response_mask"])
    return out


def select_rows(tensors: Mapping[str, torch.Tensor], idx: torch.Tensor, device: torch.device) -> dict:
    """``{key: tensor[idx]}`` moved to ``device``."""
    return {k: v[idx.to(v.device)].to(device) for k, v in tensors.items()}


def mini_batch_indices(num_rows: int, mini_batch_size: int, shuffle: bool, generator: torch.Generator):
    """Row-index groups of ``mini_batch_size`` (a random permutation first when ``shuffle``)."""
    if mini_batch_size is None or mini_batch_size <= 0:
        raise ValueError(f"ppo_mini_batch_size must be a positive int (responses per rank), got {mini_batch_size!r}")
    order = torch.randperm(num_rows, generator=generator) if shuffle else torch.arange(num_rows)
    return list(order.split(mini_batch_size))


def micro_batches(tensors: Mapping[str, torch.Tensor], idx: torch.Tensor, micro_batch_size, use_dynamic_bsz,
                  max_token_len, shared_prefix: bool = False) -> list[torch.Tensor]:
    """Row indices (into the full batch) of each micro-batch of the mini-batch ``idx``: rows of similar
    length together (less padding computed; the accumulated gradient does not depend on the split),
    or with ``shared_prefix`` rows of one prompt together (`forward_micro_batches`)."""
    rows = idx.to(tensors["attention_mask"].device)
    mask = tensors["attention_mask"][rows]
    prompts = prompt_key(tensors["input_ids"][rows], mask, tensors["responses"].shape[1]) if shared_prefix else None
    groups = forward_micro_batches(mask, micro_batch_size, use_dynamic_bsz, max_token_len, prompts)
    return [idx[g] for g in groups]
