"""The one update engine: every trained role and every objective runs this loop.

``epochs`` x mini-batches (one optimizer step each) x micro-batches (gradient accumulation), with
the non-finite guard. The caller supplies its `UpdateLoop` (sizes, and whether rows are pairs kept
whole), its ``normalisers`` (the mini-batch totals over all ranks its loss divides by) and its
``micro_step(micro_batch, normalisers, meter) -> loss`` (forward, loss, backward): the actor builds
it from an objective (`posttrain.algorithms.objectives`), the critic from its value loss.
Everything that must happen alike on every rank lives here: the same number of micro-batches
everywhere (each forward/backward of a sharded model is a collective; a rank with fewer rows runs
zero-weight stand-ins), the gradient norm over all shards, and skipping a non-finite step on every
rank alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

from posttrain.algorithms.objectives import StepMetricNames, UpdateLoop
from posttrain.models.microbatch import (equal_micro_batch_count, micro_batches, mini_batch_indices, select_rows,
                                        zero_loss_weight)
from posttrain.workers.common import MetricMeter, optimizer_step, step_scheduler

__all__ = ["run_update"]

MicroStep = Callable[[dict, dict, MetricMeter], torch.Tensor]
Normalisers = Callable[[dict], dict]


def run_update(data: dict[str, torch.Tensor], loop: UpdateLoop, *, micro_step: MicroStep, normalisers: Normalisers,
               names: StepMetricNames, module: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any,
               generator: torch.Generator, device: torch.device) -> dict[str, float]:
    """Run the update on ``data`` (this rank's rows, ``response_mask`` included); returns metrics
    averaged over mini-batches. The lr schedule advances once per call, after the metrics read the
    rate that was used."""
    meter = MetricMeter()
    module.train()
    rows = len(data["responses"])
    for _ in range(loop.epochs):
        for mini in mini_batch_indices(rows, loop.mini_batch_size or rows, loop.shuffle, generator):
            info = normalisers(_RowsOf(data, mini))
            optimizer.zero_grad(set_to_none=True)
            finite = True
            for mb in equal_micro_batch_count(_micro_groups(data, mini, loop)):  # FSDP: as many on every rank
                picked = select_rows(data, mb.rows, device)
                loss = micro_step(zero_loss_weight(picked) if mb.padding else picked, info, meter)
                finite = finite and bool(torch.isfinite(loss))
            grad_norm, skipped = optimizer_step(module.parameters(), optimizer, loop.grad_clip, finite)
            meter.count(names.skipped, float(skipped))
            meter.end_mini_batch(**{names.grad_norm: float(grad_norm)})
    optimizer.zero_grad(set_to_none=True)  # the gradients' memory is free for the phases before the next update
    metrics = meter.result()
    metrics[names.lr] = lr_scheduler.get_last_lr()[0]
    step_scheduler(lr_scheduler)
    return metrics


def _micro_groups(data: dict[str, torch.Tensor], mini: torch.Tensor, loop: UpdateLoop) -> list[torch.Tensor]:
    """Row indices of each micro-batch: whole pairs in order, or rows of similar length together."""
    if loop.pairs:
        return list(mini.split(2 * loop.micro_batch_size))
    return micro_batches(data, mini, loop.micro_batch_size, loop.use_dynamic_bsz, loop.max_token_len,
                         loop.shared_prefix)


class _RowsOf(Mapping):
    """``data``'s columns at rows ``index``, each selected when read (a normaliser reads one or two)."""

    def __init__(self, data: Mapping[str, torch.Tensor], index: torch.Tensor):
        self._data, self._index = data, index

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._data[key][self._index]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)
