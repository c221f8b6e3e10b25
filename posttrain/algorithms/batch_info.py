"""The normalisers a loss divides by when a batch is split into micro-batches and over ranks.

Gradient accumulation (verl issue #5625): each micro-batch's loss is aggregated with the totals of
its whole mini-batch, summed over every data-parallel rank, so the micro-batch losses sum to the
mini-batch's loss and the accumulated gradient equals the one-big-batch gradient for any split.
Because FSDP/DDP average gradients over ranks, a loss is multiplied by the world size (``dp_size``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ConfigWithBatchInfo", "global_batch_info", "summed_over_ranks", "token_normalisers"]


def summed_over_ranks(values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(values summed over every rank, world size)``: a collective when a process group is up."""
    total = values.detach().to(torch.float64).clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
        return total, dist.get_world_size()
    return total, 1


def global_batch_info(response_mask: torch.Tensor) -> dict[str, Any]:
    """``agg_loss`` normalisers of a mini-batch: ``response_mask`` ``[B, R]`` (this rank's rows)."""
    counts, dp_size = summed_over_ranks(torch.stack([response_mask.sum(), (response_mask.sum(-1) > 0).sum()]))
    return {"dp_size": dp_size, "batch_num_tokens": counts[0].item(), "global_batch_size": counts[1].item()}


def token_normalisers(data: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """`global_batch_info` of a mini-batch's columns (its ``response_mask``): the token-level losses'
    normalisers (PPO, SFT, the critic's value loss)."""
    return global_batch_info(data["response_mask"])


class ConfigWithBatchInfo:
    """A read-only view of a config section with ``global_batch_info`` added (slots configs can't take it)."""

    def __init__(self, base: Any, info: dict[str, Any]):
        self._base = base
        self.global_batch_info = info

    def __getattr__(self, name: str) -> Any:
        base = self.__dict__["_base"]
        if isinstance(base, Mapping):
            try:
                return base[name]
            except KeyError:
                raise AttributeError(name) from None
        return getattr(base, name)
