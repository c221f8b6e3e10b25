"""Pieces the actor and critic updates share: global loss normalisers, the optimizer step with non-finite protection, metric accumulation, precision from config.

Gradient accumulation (verl issue #5625). A mini-batch is split into micro-batches that are
forwarded and back-propagated one at a time. Each micro-batch loss is aggregated with the
*mini-batch's* normalisers (``batch_num_tokens`` = valid response tokens in the mini-batch,
``global_batch_size`` = its non-empty responses), so the micro-batch losses *sum* to the loss of
the whole mini-batch and the accumulated gradient equals the one-big-batch gradient for every
``loss_agg_mode`` and any micro-batch split (rows or tokens). Under ``torch.distributed`` the
counts are summed over ranks and the loss is multiplied by the world size, because DDP/FSDP
average gradients across ranks. How a batch splits into mini- and micro-batches: `posttrain.models.microbatch`.
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import torch

from posttrain.algorithms.batch_info import ConfigWithBatchInfo, global_batch_info
from posttrain.batch import response_mask_of

__all__ = [
    "ConfigWithBatchInfo",
    "MetricMeter",
    "global_batch_info",
    "optimizer_step",
    "response_mask_of",
    "step_scheduler",
]


def optimizer_step(params, optimizer: torch.optim.Optimizer, grad_clip: float | None,
                   loss_finite: bool = True) -> tuple[torch.Tensor, bool]:
    """Clip, then step unless the loss or the gradient norm is non-finite (then zero the grads).

    Returns (pre-clip total grad norm, whether the step was skipped).
    """
    params = [p for p in params if p.grad is not None]
    max_norm = float(grad_clip) if grad_clip is not None and grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm) if params else torch.tensor(0.0)
    skipped = not (loss_finite and bool(torch.isfinite(grad_norm)))
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    return grad_norm.detach(), skipped


def step_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Advance the lr schedule; silences torch's order warning when every optimizer step was skipped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        scheduler.step()


class MetricMeter:
    """Sums per-micro-batch contributions into per-mini-batch values, then averages mini-batches."""

    def __init__(self):
        self._current: dict[str, torch.Tensor | float] = defaultdict(float)
        self._done: dict[str, list[float]] = defaultdict(list)
        self.counts: dict[str, float] = defaultdict(float)

    def add(self, name: str, value: torch.Tensor | float, weight: float = 1.0) -> None:
        """Add ``weight * value`` to the current mini-batch's ``name``."""
        value = value.detach().float() if isinstance(value, torch.Tensor) else float(value)
        self._current[name] = self._current[name] + value * weight

    def end_mini_batch(self, **values: float) -> None:
        """Close the current mini-batch (``values`` are per-mini-batch extras like grad_norm)."""
        for name, value in list(self._current.items()) + list(values.items()):
            self._done[name].append(float(value))
        self._current = defaultdict(float)

    def count(self, name: str, amount: float = 1.0) -> None:
        """A summed (not averaged) counter, e.g. skipped steps."""
        self.counts[name] += amount

    def result(self) -> dict[str, float]:
        out = {k: sum(v) / len(v) for k, v in self._done.items() if v}
        out.update(self.counts)
        return out
