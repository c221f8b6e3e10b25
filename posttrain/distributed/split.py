"""Moving a batch between the driver and ``W`` data-parallel ranks, and combining what comes back.

Pure functions (no Ray, no ``torch.distributed``), so every rule here is unit-tested in one process.

Shapes: ``N`` rows in the driver's batch, ``W`` ranks, ``c = ceil(N / W)`` rows per rank.

- :func:`split_for_ranks` pads the batch to a multiple of ``W`` (``posttrain.batch.pad_to_divisor``
  repeats rows from the start) and cuts it into ``W`` contiguous chunks of ``c`` rows: every rank
  gets the same number of rows, so every rank runs the same number of micro-batches and
  collectives (an unequal count deadlocks FSDP). :func:`gather_from_ranks` concatenates what the
  ranks return (a ``Batch``, tensors, tuples of them, ``None``) and drops the padding rows.
- :func:`balance_batch` reorders rows before the split so that every chunk holds a similar number of
  tokens (verl's ``trainer.balance_batch``); the returned permutation undoes it.
- :func:`pad_pairs` keeps (chosen, rejected) row pairs whole across ranks: it pads with zero-weight
  pairs to a multiple of ``2 x W`` rows, so contiguous chunks split no pair.
- :func:`combine_metrics` merges the per-rank metric dicts of ``update_policy``/``update_critic``;
  the rule for each metric follows from how ``posttrain/workers`` computes it (see ``METRIC_RULES``).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from posttrain.batch import Batch, pad_to_divisor, unpad

__all__ = [
    "METRIC_RULES",
    "balance_batch",
    "balanced_partition",
    "combine_metrics",
    "pad_pairs",
    "split_update",
    "gather_from_ranks",
    "inverse_permutation",
    "rank_row_counts",
    "split_for_ranks",
]


# ------------------------------------------------------------------------------------------ split / gather
def split_for_ranks(data: Batch | torch.Tensor, world_size: int,
                    inert_padding: bool = False) -> tuple[list[Any], int]:
    """``(chunks, pad)``: ``data`` padded to a multiple of ``world_size`` rows, cut into ``world_size``
    contiguous equal chunks (chunk ``r`` goes to rank ``r``); ``pad`` rows were added at the end.

    Padding rows are copies of the first rows. That is harmless for inference (their outputs are
    dropped by :func:`gather_from_ranks`), but an update would train on them twice; with
    ``inert_padding=True`` (a ``Batch`` only) the padding rows get ``response_mask`` 0, so they add
    nothing to any loss or to the global token/sequence counts the losses are normalised by.
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if isinstance(data, torch.Tensor):
        return _split_tensor(data, world_size)
    if not isinstance(data, Batch):
        raise TypeError(f"split_for_ranks takes a Batch or a tensor, got {type(data).__name__}")
    padded, pad = pad_to_divisor(data, world_size)
    if pad and inert_padding:
        _zero_response_mask(padded, len(data))
    return padded.chunk(world_size), pad


def pad_pairs(batch: Batch, world_size: int) -> Batch:
    """``batch`` (chosen/rejected row pairs with ``pair_weight``) with copies of its first pair, weight 0,
    appended until the rows are a multiple of ``2 x world_size``, so contiguous chunks keep pairs whole."""
    rows = len(batch)
    missing_pairs = (-(rows // 2)) % world_size
    if not missing_pairs:
        return batch
    filler = Batch.concat([batch.index_select(torch.tensor([0, 1]))] * missing_pairs)
    filler["pair_weight"] = torch.zeros_like(filler["pair_weight"])
    return Batch.concat([batch, filler])


def split_update(batch: Batch, world_size: int, pairs: bool) -> list[Batch]:
    """An update's batch over the ranks: whole pairs in contiguous chunks (``pairs``), else rows with
    padding rows that train nothing (their response mask is zero)."""
    if pairs:
        return list(pad_pairs(batch, world_size).chunk(world_size))
    chunks, _ = split_for_ranks(batch, world_size, inert_padding=True)
    return chunks


def _split_tensor(t: torch.Tensor, world_size: int) -> tuple[list[torch.Tensor], int]:
    if t.dim() == 0 or t.shape[0] == 0:
        raise ValueError(f"cannot split a tensor of shape {list(t.shape)} over ranks: it needs rows")
    pad = -t.shape[0] % world_size
    if pad:  # same rule as pad_to_divisor: repeat rows from the start
        t = torch.cat([t, t[torch.arange(pad) % t.shape[0]]])
    return list(t.chunk(world_size)), pad


def _zero_response_mask(padded: Batch, real_rows: int) -> None:
    """Give rows ``real_rows:`` a zero ``response_mask`` (created from ``attention_mask`` if absent).
    ``padded`` is a fresh concatenation, so this never writes into the caller's batch."""
    if "response_mask" in padded:
        mask = padded["response_mask"].clone()
    else:  # the workers' default: the response part of attention_mask
        mask = padded["attention_mask"][:, -padded["responses"].shape[1]:].clone()
    mask[real_rows:] = 0
    padded["response_mask"] = mask


def gather_from_ranks(outputs: Sequence[Any], pad: int) -> Any:
    """Concatenate the per-rank ``outputs`` (in rank order) and drop the last ``pad`` rows.

    Each rank's output is a ``Batch``, a tensor with rows first, ``None``, or a tuple/list of those
    (e.g. ``compute_log_prob``'s ``(log_probs, entropy or None)``), the same kind on every rank.
    """
    if not outputs:
        raise ValueError("gather_from_ranks needs at least one rank's output")
    first = outputs[0]
    if first is None:
        if any(o is not None for o in outputs):
            raise ValueError("gather_from_ranks: rank 0 returned None but other ranks returned values")
        return None
    if isinstance(first, Batch):
        _same_kind(outputs, Batch)
        return unpad(Batch.concat(list(outputs)), pad)
    if isinstance(first, torch.Tensor):
        _same_kind(outputs, torch.Tensor)
        cat = torch.cat(list(outputs), dim=0)
        return cat[: cat.shape[0] - pad] if pad else cat
    if isinstance(first, (tuple, list)):
        if any(not isinstance(o, (tuple, list)) or len(o) != len(first) for o in outputs):
            raise ValueError(f"gather_from_ranks: ranks returned sequences of different lengths: "
                             f"{[len(o) if isinstance(o, (tuple, list)) else type(o).__name__ for o in outputs]}")
        return type(first)(gather_from_ranks([o[i] for o in outputs], pad) for i in range(len(first)))
    raise TypeError(f"gather_from_ranks: cannot concatenate {type(first).__name__} outputs "
                    f"(expected Batch, tensor, None or a tuple of them)")


def _same_kind(outputs: Sequence[Any], kind: type) -> None:
    kinds = [type(o).__name__ for o in outputs]
    if not all(isinstance(o, kind) for o in outputs):
        raise ValueError(f"gather_from_ranks: ranks returned different kinds: {kinds}")


# ------------------------------------------------------------------------------------------ balance
def rank_row_counts(num_rows: int, world_size: int) -> list[int]:
    """Real (non-padding) rows each rank gets from :func:`split_for_ranks`: chunks of
    ``ceil(N / W)``, padding at the end, so the last ranks may hold fewer real rows (or none)."""
    size = math.ceil(num_rows / world_size)
    return [min(size, max(0, num_rows - r * size)) for r in range(world_size)]


def balanced_partition(weights: Sequence[float], sizes: Sequence[int]) -> list[list[int]]:
    """Indices of ``weights`` split into groups of exactly ``sizes[g]`` items with similar sums.

    Greedy longest-processing-time with a size limit (heaviest item first, into the lightest group
    that still has room), then swaps between the heaviest and the lightest group while a swap
    narrows their gap. The greedy step alone is within one item of the best split; the swaps repair
    the end of the greedy pass, where small groups that are full force items elsewhere.
    """
    w = np.asarray(weights, dtype=np.float64)
    if sum(sizes) != len(w) or any(s < 0 for s in sizes):
        raise ValueError(f"group sizes {list(sizes)} must be >= 0 and sum to the {len(w)} items")
    groups: list[list[int]] = [[] for _ in sizes]
    sums = np.zeros(len(sizes))
    for i in np.argsort(-w, kind="stable"):
        open_groups = [g for g in range(len(sizes)) if len(groups[g]) < sizes[g]]
        g = min(open_groups, key=lambda k: sums[k])
        groups[g].append(int(i))
        sums[g] += w[i]
    _refine_by_swaps(w, groups)
    return [sorted(g) for g in groups]


def _refine_by_swaps(w: np.ndarray, groups: list[list[int]], max_swaps: int = 100) -> None:
    """Swap one item between the heaviest and the lightest group while that reduces their gap
    (groups of size 0, a rank with only padding rows, have nothing to swap and are left out)."""
    live = [g for g in groups if g]
    for _ in range(max_swaps):
        sums = [w[g].sum() for g in live]
        hi, lo = int(np.argmax(sums)), int(np.argmin(sums))
        gap = sums[hi] - sums[lo]
        if gap <= 0:
            return
        # moving a from hi and b from lo changes the gap to |gap - 2 (a - b)|; best when a - b = gap / 2
        delta = w[live[hi]][:, None] - w[live[lo]][None, :]
        new_gap = np.abs(gap - 2 * delta)
        a, b = np.unravel_index(np.argmin(new_gap), new_gap.shape)
        if new_gap[a, b] >= gap - 1e-9:
            return
        live[hi][a], live[lo][b] = live[lo][b], live[hi][a]  # the lists are groups' own, so groups change


def balance_batch(batch: Batch, world_size: int) -> np.ndarray:
    """Reorder ``batch``'s rows in place so that each rank's chunk from :func:`split_for_ranks` holds a
    similar number of tokens (``attention_mask`` sums), as verl's ``trainer.balance_batch`` does.

    Returns ``perm``: new row ``i`` is old row ``perm[i]``. Results computed on the reordered batch go
    back to the original order with ``results[inverse_permutation(perm)]``. Rows keep their ``uid``,
    so GRPO-style grouping (by ``uid`` value, not by position) is unaffected.
    """
    lengths = batch["attention_mask"].sum(-1).cpu().numpy()
    groups = balanced_partition(lengths, rank_row_counts(len(batch), world_size))
    perm = np.concatenate([np.asarray(g, dtype=np.int64) for g in groups])
    batch.reorder(perm)
    return perm


def inverse_permutation(perm: Sequence[int]) -> np.ndarray:
    """``inv`` with ``inv[perm[i]] = i``: ``x_reordered[inv]`` is ``x`` in the original row order."""
    perm = np.asarray(perm, dtype=np.int64)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(len(perm))
    return inv


# ------------------------------------------------------------------------------------------ metrics
# How each rank's update metrics combine into the one-process value. ``W`` = world size, ``T`` =
# valid response tokens (or non-empty sequences, for seq-mean modes) of a mini-batch over ALL ranks.
#
# "mean"  Losses. ``global_batch_info`` gives every rank the global count ``T`` and ``dp_size = W``,
#         and ``agg_loss`` multiplies by ``dp_size`` (posttrain/algorithms/losses.py) because
#         FSDP averages gradients over ranks. So rank r reports ``W * S_r / T`` (``S_r`` = its part
#         of the loss sum), the ranks' values sum to ``W * S / T`` and their MEAN is the
#         one-process loss ``S / T``. Holds for every loss_agg_mode (token-sum: ``W * S_r`` -> mean
#         ``S``). Each rank has the same number of mini-batches, so averaging mini-batches commutes.
# "sum"   Token means that the workers weight by the micro-batch's token share
#         ``tokens_mb / T`` (``MetricMeter.add(name, value, share)`` in workers/actor.py and
#         critic.py): a rank's value is its part ``sum_{its tokens} x / T`` of the global mean,
#         without a ``W`` factor, so the SUM over ranks is the one-process value. This covers
#         every policy-loss metric (pg_clipfrac, ppo_kl, pg_clipfrac_lower, ...).
# "rank0" Values every rank computes identically: the clipped grad norm is taken over the whole
#         sharded model (a collective), the lr schedule and the KL coefficient are config-driven,
#         and a step is skipped when that global grad norm is non-finite, so the skip counters
#         agree too. Rank 0's value is reported after checking the others match (a mismatch means
#         the ranks' models have diverged, which is a bug worth stopping for).
# "max"   Per-rank resource peaks (memory): the worst rank is what matters.
# Anything else: "mean" (verl's behaviour for per-rank metrics).
METRIC_RULES: list[tuple[str, str]] = [
    ("*/grad_norm", "rank0"),
    ("*/lr", "rank0"),
    ("*/kl_coef", "rank0"),
    ("*/nonfinite_skipped", "rank0"),
    ("actor/pg_loss", "mean"),
    ("actor/kl_loss", "mean"),
    ("actor/entropy", "mean"),
    ("critic/vf_loss", "mean"),
    ("critic/vf_clipfrac", "sum"),
    ("critic/vpred_mean", "sum"),
    ("actor/*", "sum"),  # the remaining actor metrics are the policy loss's, token-share weighted
    ("distillation/loss", "mean"),  # the distillation loss (posttrain.algorithms.objectives.Distill)
    ("distillation/*", "sum"),  # its token means, token-share weighted
    ("perf/max_*", "max"),
    ("*", "mean"),
]


def metric_rule(name: str, rules: Sequence[tuple[str, str]] = METRIC_RULES) -> str:
    """The rule (``mean``, ``sum``, ``rank0``, ``max``) of the first pattern in ``rules`` matching ``name``."""
    for pattern, rule in rules:
        if fnmatch.fnmatchcase(name, pattern):
            return rule
    return "mean"


def combine_metrics(per_rank: Sequence[dict[str, Any]], rules: Sequence[tuple[str, str]] = METRIC_RULES,
                    rtol: float = 1e-5) -> dict[str, float]:
    """One dict from the ranks' metric dicts (rank order), each metric combined by its rule in
    ``rules`` (see ``METRIC_RULES`` for why each rule is the right one).

    Raises ``ValueError`` when ranks report different keys, or when a ``rank0`` metric differs
    between ranks by more than ``rtol``.
    """
    if not per_rank:
        raise ValueError("combine_metrics needs at least one rank's metrics")
    keys = list(per_rank[0])
    for r, m in enumerate(per_rank[1:], start=1):
        if set(m) != set(keys):
            raise ValueError(f"combine_metrics: rank {r} reports {sorted(set(m) ^ set(keys))} "
                             f"unlike rank 0; every rank must report the same metrics")
    return {k: _combine_one(k, [_as_float(m[k]) for m in per_rank], metric_rule(k, rules), rtol) for k in keys}


def _as_float(value: Any) -> float:
    return float(value.item()) if isinstance(value, (torch.Tensor, np.ndarray)) else float(value)


def _combine_one(name: str, values: list[float], rule: str, rtol: float) -> float:
    if rule == "mean":
        return float(np.mean(values))
    if rule == "sum":
        return float(np.sum(values))
    if rule == "max":
        return float(np.max(values))
    if rule == "rank0":
        ref = np.full(len(values), values[0])
        if not np.allclose(values, ref, rtol=rtol, atol=1e-12, equal_nan=True):
            raise ValueError(f"metric {name!r} must be identical on every rank, got {values} (ranks 0..): "
                             f"the ranks disagree on a global quantity, so their models have diverged")
        return values[0]
    raise ValueError(f"unknown metric rule {rule!r} for {name!r}; rules: mean, sum, rank0, max")
