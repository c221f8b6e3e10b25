"""The actor's supervised and preference updates: SFT's token-mean NLL and DPO's pair loss.

Both run on the actor's model, optimizer and log-prob code (`response_logprobs`, with
``use_remove_padding`` / ``use_prefix_grouper``), on batches in the RL layout
(`posttrain.data.sft`): ``response_mask`` marks the trained tokens.

SFT (`sft_update`): one optimizer step per call. The loss is the negative log-likelihood summed over
trained tokens divided by the number of trained tokens of the WHOLE batch over all ranks
(`global_batch_info`), times the world size because FSDP averages gradients: gradient accumulation
over micro-batches and any number of ranks give the one-process gradient. It is the RL update
loop (`ppo_update`) with one epoch of one mini-batch and this loss.

DPO (`dpo_update`): rows come in pairs, chosen at even rows and rejected at the odd row after it,
sharing their prompt; ``ref_logps`` ``[N]`` holds the reference's summed log-probs of each row and
``pair_weight`` ``[N]`` is 1 for real pairs and 0 for the padding pairs that make every rank hold as
many pairs (a zero weight adds nothing to the loss or to the pair count). Micro-batches hold
``micro_batch_size_per_gpu`` pairs; the loss is the mean over all pairs of all ranks. The loss
function is `posttrain.algorithms.dpo.dpo_loss` (TRL's semantics), given each response's number of
response tokens (`pair_logps`: what ``ipo`` averages its log-ratios by); the metrics are `dpo_metrics`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.distributed as dist

from posttrain.algorithms import agg_loss
from posttrain.models import compute_response_logprobs, response_logprobs
from posttrain.workers.common import MetricMeter, optimizer_step, step_scheduler
from posttrain.workers.update import ppo_update

__all__ = ["actor_sequence_logps", "dpo_update", "sequence_logps", "sft_loss_sums", "sft_update"]

_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


def _forward(actor: Any, mb: dict) -> torch.Tensor:
    """Per-token log-probs ``[B, R]`` of the micro-batch's responses, with gradients."""
    cfg = actor.config
    with actor.autocast():
        log_prob, _ = response_logprobs(actor.module, *(mb[k] for k in _KEYS), temperature=1.0,
                                        remove_padding=bool(cfg.use_remove_padding),
                                        shared_prefix=bool(cfg.use_prefix_grouper))
    return log_prob


def sft_update(actor: Any, batch: Any) -> dict[str, float]:
    """One optimizer step of token-mean NLL on ``batch``'s ``response_mask`` tokens; metrics
    ``train/loss`` (the batch's mean NLL per trained token), ``train/grad_norm``, ``train/lr``."""
    cfg = actor.config
    data = {k: batch[k] for k in (*_KEYS, "response_mask")}
    loop = SimpleNamespace(ppo_epochs=1, ppo_mini_batch_size=max(1, len(data["responses"])), shuffle=False,
                           ppo_micro_batch_size_per_gpu=cfg.ppo_micro_batch_size_per_gpu, use_dynamic_bsz=False,
                           ppo_max_token_len_per_gpu=None, grad_clip=cfg.grad_clip)

    def micro_step(mb: dict, info: dict, meter: MetricMeter) -> torch.Tensor:
        nll = -_forward(actor, mb)
        loss = agg_loss(nll, mb["response_mask"].to(nll.dtype), "token-mean", **info)
        loss.backward()
        meter.add("train/loss", loss)
        return loss.detach()

    metrics = ppo_update(data, loop, micro_step=micro_step, module=actor.module, optimizer=actor.optimizer,
                         lr_scheduler=actor.lr_scheduler, generator=actor.generator, device=actor.device,
                         prefix="train", shared_prefix=bool(cfg.use_prefix_grouper))
    actor.weights_version += 1
    return metrics


def sequence_logps(module: torch.nn.Module, batch: Any, *, micro_batch_size: int, autocast: Callable,
                   remove_padding: bool = False, shared_prefix: bool = False) -> torch.Tensor:
    """``[N, 2]``: per row, the summed log-prob of its ``response_mask`` tokens under ``module`` and
    their count; no grad (the policy, the frozen reference, or the LoRA policy with adapters off)."""
    module.eval()
    log_probs, _ = compute_response_logprobs(module, batch, micro_batch_size, 1.0, False, autocast=autocast,
                                             remove_padding=remove_padding, shared_prefix=shared_prefix)
    mask = batch["response_mask"].to(log_probs.device, log_probs.dtype)
    return torch.stack([(log_probs * mask).sum(-1), mask.sum(-1)], dim=-1)


def actor_sequence_logps(actor: Any, batch: Any) -> torch.Tensor:
    """`sequence_logps` under the actor's current weights and micro-batch settings."""
    cfg = actor.config
    return sequence_logps(actor.module, batch, micro_batch_size=cfg.ppo_micro_batch_size_per_gpu,
                          autocast=actor.autocast, remove_padding=bool(cfg.use_remove_padding),
                          shared_prefix=bool(cfg.use_prefix_grouper))


def sft_loss_sums(actor: Any, batch: Any) -> torch.Tensor:
    """``[N, 2]``: per row, the NLL summed over trained tokens and their count (validation loss = sum/sum)."""
    sums = actor_sequence_logps(actor, batch)
    return torch.stack([-sums[:, 0], sums[:, 1]], dim=-1)


def _global_sum(value: torch.Tensor) -> tuple[float, int]:
    """``(sum over ranks, world size)``."""
    total = value.detach().to(torch.float64).clone()
    world = 1
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
        world = dist.get_world_size()
    return float(total), world


def dpo_update(actor: Any, batch: Any, beta: float, loss_type: str, label_smoothing: float) -> dict[str, float]:
    """One optimizer step of the DPO loss on ``batch``'s pairs (module docstring); TRL's metric names."""
    from posttrain.algorithms.dpo import dpo_loss, dpo_metrics, pair_logps

    rows = len(batch["responses"])
    if rows % 2:
        raise ValueError(f"dpo_update needs chosen/rejected pairs (an even number of rows), got {rows}")
    keys = (*_KEYS, "response_mask", "ref_logps", "pair_weight")
    data = {k: batch[k] for k in keys}
    weight = data["pair_weight"][0::2].to(torch.float64)
    pairs, world = _global_sum(weight.sum())
    scale = world / max(pairs, 1.0)  # FSDP averages gradients over ranks; the mean is over all ranks' pairs
    per_micro = max(1, int(actor.config.ppo_micro_batch_size_per_gpu))
    actor.module.train()
    actor.optimizer.zero_grad(set_to_none=True)
    meter, finite = MetricMeter(), True
    for start in range(0, rows // 2, per_micro):
        sel = torch.arange(2 * start, min(rows, 2 * (start + per_micro)))
        mb = {k: v[sel].to(actor.device) for k, v in data.items()}
        chosen, rejected, chosen_lengths, rejected_lengths = pair_logps(_forward(actor, mb), mb["response_mask"])
        ref = mb["ref_logps"].to(chosen.dtype)
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            chosen, rejected, ref[0::2], ref[1::2], beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
            chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
        w = mb["pair_weight"][0::2].to(losses.dtype)
        loss = (losses * w).sum() * scale
        loss.backward()
        finite = finite and bool(torch.isfinite(loss))
        meter.add("loss", loss.detach())
        real = w > 0  # padding pairs (weight 0) count in the metrics no more than in the loss
        stats = dpo_metrics(chosen_rewards[real], rejected_rewards[real], chosen[real], rejected[real])
        for name, mean in stats.items():  # this micro-batch's share of the mean over all ranks' pairs
            meter.add(name, mean * int(real.sum()) * scale if bool(real.any()) else 0.0)
    grad_norm, skipped = optimizer_step(actor.module.parameters(), actor.optimizer, actor.config.grad_clip, finite)
    meter.count("nonfinite_skipped", float(skipped))
    meter.end_mini_batch(grad_norm=float(grad_norm))
    metrics = meter.result()
    metrics["learning_rate"] = actor.lr_scheduler.get_last_lr()[0]
    step_scheduler(actor.lr_scheduler)
    actor.weights_version += 1
    return metrics


def pad_pairs(batch: Any, world_size: int) -> Any:
    """``batch`` (chosen/rejected row pairs with ``pair_weight``) with copies of its first pair, weight 0,
    appended until the rows are a multiple of ``2 x world_size``, so contiguous chunks keep pairs whole."""
    from posttrain.batch import Batch

    rows = len(batch)
    missing_pairs = (-(rows // 2)) % world_size
    if not missing_pairs:
        return batch
    filler = Batch.concat([batch.index_select(torch.tensor([0, 1]))] * missing_pairs)
    filler["pair_weight"] = torch.zeros_like(filler["pair_weight"])
    return Batch.concat([batch, filler])
