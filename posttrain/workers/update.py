"""The PPO update loop the actor and the critic share: ``ppo_epochs`` x mini-batches (one optimizer
step each) x micro-batches (gradient accumulation), with the non-finite guard.

Each role supplies only its ``micro_step(micro_batch, batch_info, meter) -> loss``: the forward, the
loss normalised by the mini-batch totals in ``batch_info`` (see ``common.py``) and its backward.
Everything that must happen alike on every rank lives here: the global token counts, the same
number of micro-batches everywhere (each forward/backward of a sharded model is a collective; a
rank with fewer rows runs zero-weight stand-ins), the gradient norm over all shards, and skipping
a non-finite step on every rank alike.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from posttrain.models.microbatch import equal_micro_batch_count, zero_loss_weight
from posttrain.workers.common import (MetricMeter, global_batch_info, micro_batches, mini_batch_indices,
                                      optimizer_step, select_rows, step_scheduler)

__all__ = ["ppo_update"]

MicroStep = Callable[[dict, dict, MetricMeter], torch.Tensor]


def ppo_update(data: dict[str, torch.Tensor], cfg: Any, *, micro_step: MicroStep, module: torch.nn.Module,
               optimizer: torch.optim.Optimizer, lr_scheduler: Any, generator: torch.Generator,
               device: torch.device, prefix: str, shared_prefix: bool = False) -> dict[str, float]:
    """Run the update on ``data`` (this rank's rows, ``response_mask`` included); returns metrics.

    cfg: the role's section with ``ppo_epochs``, ``ppo_mini_batch_size`` (responses per rank),
    ``shuffle``, ``ppo_micro_batch_size_per_gpu``, ``use_dynamic_bsz``, ``ppo_max_token_len_per_gpu``
    and ``grad_clip``. ``prefix`` names the metrics (``actor`` / ``critic``). ``shared_prefix`` keeps
    the rows of one prompt in one micro-batch (the actor's ``use_prefix_grouper``). The lr schedule
    advances once per call, after the metrics read the rate that was used.
    """
    meter = MetricMeter()
    module.train()
    for _ in range(cfg.ppo_epochs):
        for mini in mini_batch_indices(len(data["responses"]), cfg.ppo_mini_batch_size, cfg.shuffle, generator):
            info = global_batch_info(data["response_mask"][mini])
            optimizer.zero_grad(set_to_none=True)
            finite = True
            groups = micro_batches(data, mini, cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz,
                                   cfg.ppo_max_token_len_per_gpu, shared_prefix)
            for mb in equal_micro_batch_count(groups):  # FSDP: every rank runs as many forwards/backwards
                rows = select_rows(data, mb.rows, device)
                loss = micro_step(zero_loss_weight(rows) if mb.padding else rows, info, meter)
                finite = finite and bool(torch.isfinite(loss))
            grad_norm, skipped = optimizer_step(module.parameters(), optimizer, cfg.grad_clip, finite)
            meter.count(f"{prefix}/nonfinite_skipped", float(skipped))
            meter.end_mini_batch(**{f"{prefix}/grad_norm": float(grad_norm)})
    optimizer.zero_grad(set_to_none=True)  # the gradients' memory is free for the phases before the next update
    metrics = meter.result()
    metrics[f"{prefix}/lr"] = lr_scheduler.get_last_lr()[0]
    step_scheduler(lr_scheduler)
    return metrics
