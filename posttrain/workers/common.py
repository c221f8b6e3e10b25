"""Pieces the actor and critic updates share: mini-batches, global loss normalisers, the
optimizer step with non-finite protection, metric accumulation, precision from config.

Gradient accumulation (verl issue #5625). A mini-batch is split into micro-batches that are
forwarded and back-propagated one at a time. Each micro-batch loss is aggregated with the
*mini-batch's* normalisers (``batch_num_tokens`` = valid response tokens in the mini-batch,
``global_batch_size`` = its non-empty responses), so the micro-batch losses *sum* to the loss of
the whole mini-batch and the accumulated gradient equals the one-big-batch gradient for every
``loss_agg_mode`` and any micro-batch split (rows or tokens). Under ``torch.distributed`` the
counts are summed over ranks and the loss is multiplied by the world size, because DDP/FSDP
average gradients across ranks.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Mapping

import torch

from posttrain.algorithms.batch_info import ConfigWithBatchInfo, global_batch_info
from posttrain.batch import response_mask_of
from posttrain.models.microbatch import forward_micro_batches
from posttrain.models.shared_prefix import prompt_key

__all__ = [
    "ConfigWithBatchInfo",
    "MetricMeter",
    "global_batch_info",
    "mini_batch_indices",
    "optimizer_step",
    "response_mask_of",
    "select_rows",
    "step_scheduler",
]


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
