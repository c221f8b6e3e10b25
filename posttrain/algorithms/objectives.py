"""Objectives: what one update of the actor optimises, handed to the one update engine.

The engine (`posttrain.workers.update.run_update`, called by ``ActorWorker.train(batch, objective)``)
owns everything every objective does alike: epochs x mini-batches (one optimizer step each) x
micro-batches (gradient accumulation), the same number of micro-batches on every rank, the
non-finite guard, the gradient norm and the lr schedule. An objective supplies only what differs:

- ``columns(batch, cfg)``: the batch columns its loss reads (checked here, before any forward);
- ``loop(cfg, rows)``: its `UpdateLoop` (epochs, mini/micro-batch sizes, and ``pairs``: whether
  rows are (chosen, rejected) pairs that stay whole, in order, when split over micro-batches and ranks);
- ``normalisers(data)``: the mini-batch totals over all ranks its loss divides by (a collective);
- ``loss(log_prob, entropy, mb, info, meter, cfg)``: one micro-batch's loss from the policy's
  per-token log-probs ``[B, R]`` (the engine runs the forward and the backward);
- the names of its step metrics (``grad_norm``, skipped steps, learning rate).

This is verl's ``TrainingWorker.set_loss_fn`` shape: the worker runs the model, the objective is a
loss. An objective is a small frozen dataclass, so it crosses a process boundary (Ray, torchrun)
with the batch. A new objective is a class here plus the trainer that feeds it; nothing in the
worker groups or `posttrain.distributed` changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch

from posttrain.algorithms.batch_info import ConfigWithBatchInfo, summed_over_ranks, token_normalisers
from posttrain.algorithms.distillation import (DistillationScores, combine_with_policy_loss, distillation_loss,
                                               distillation_loss_spec, distillation_token_losses,
                                               sampled_token_metrics)
from posttrain.algorithms.dpo import dpo_loss, dpo_metrics, pair_logps, simpo_loss
from posttrain.algorithms.kl import kl_penalty
from posttrain.algorithms.losses import agg_loss, with_loss_scale_factor
from posttrain.algorithms.policy_losses import get_policy_loss_fn
from posttrain.algorithms.utils import masked_mean
from posttrain.batch import response_mask_of

__all__ = ["DPO", "LOGPROB_KEYS", "Distill", "Objective", "PPO", "SFT", "SimPO", "StepMetricNames", "UpdateLoop",
           "ppo_loop"]

LOGPROB_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
"""What the policy's forward reads."""


@dataclass(frozen=True)
class UpdateLoop:
    """How the engine walks one call's rows (sizes are per rank, as in verl's workers)."""

    micro_batch_size: int
    grad_clip: float | None
    epochs: int = 1
    mini_batch_size: int | None = None
    """Rows per optimizer step; None: the whole batch is one step."""
    shuffle: bool = False
    use_dynamic_bsz: bool = False
    max_token_len: int | None = None
    pairs: bool = False
    """Rows are (chosen, rejected) pairs: micro-batches hold ``micro_batch_size`` whole pairs, in order."""
    shared_prefix: bool = False
    """Rows of one prompt share a micro-batch (the actor's ``use_prefix_grouper``)."""


def ppo_loop(cfg: Any, shared_prefix: bool = False) -> UpdateLoop:
    """verl's PPO loop from an actor or critic section: ``ppo_epochs`` x ``ppo_mini_batch_size`` x
    ``ppo_micro_batch_size_per_gpu`` (or ``ppo_max_token_len_per_gpu`` tokens with ``use_dynamic_bsz``)."""
    return UpdateLoop(micro_batch_size=cfg.ppo_micro_batch_size_per_gpu, grad_clip=cfg.grad_clip,
                      epochs=cfg.ppo_epochs, mini_batch_size=cfg.ppo_mini_batch_size, shuffle=cfg.shuffle,
                      use_dynamic_bsz=cfg.use_dynamic_bsz, max_token_len=cfg.ppo_max_token_len_per_gpu,
                      shared_prefix=shared_prefix)


@dataclass(frozen=True)
class StepMetricNames:
    grad_norm: str
    skipped: str
    lr: str


class Objective:
    """The interface (module docstring); subclasses are frozen dataclasses of their knobs."""

    name: ClassVar[str]
    metric_names: ClassVar[StepMetricNames]
    pairs: ClassVar[bool] = False
    """Rows are (chosen, rejected) pairs that a split over ranks or micro-batches keeps whole."""
    temperature_from_batch: ClassVar[bool] = False
    """Log-probs at the rollout's temperature (RL) rather than 1 (supervised and preference data)."""
    needs_reference: ClassVar[bool] = False
    """Whether the trainer must provide reference log-probs (decides whether a reference model loads)."""

    def columns(self, batch: Any, cfg: Any) -> list[str]:
        return [*LOGPROB_KEYS, "response_mask"]

    def loop(self, cfg: Any, rows: int) -> UpdateLoop:
        return UpdateLoop(micro_batch_size=cfg.ppo_micro_batch_size_per_gpu, grad_clip=cfg.grad_clip,
                          mini_batch_size=max(1, rows), shared_prefix=bool(cfg.use_prefix_grouper))

    def normalisers(self, data: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return token_normalisers(data)

    def entropy(self, cfg: Any) -> tuple[bool, bool]:
        """``(compute the entropy, with its gradient)``."""
        return False, False

    def loss(self, log_prob: torch.Tensor, entropy: torch.Tensor | None, mb: dict, info: dict, meter: Any,
             cfg: Any) -> torch.Tensor:
        raise NotImplementedError

    def finish(self, metrics: dict[str, float], cfg: Any) -> None:
        """Add call-level metrics after the update (default: none)."""

    def gathered_ids(self) -> str | None:
        """The column of token ids ``[B, R, K]`` at which the worker's forward also returns the policy's
        log-probs (``mb["student_topk_log_probs"]``, with its own top-k ids in ``mb["student_topk_ids"]``);
        None (every objective but top-k distillation): the sampled tokens' log-probs only."""
        return None


@dataclass(frozen=True)
class PPO(Objective):
    """verl's actor update: the registered policy loss (``policy_loss.loss_mode``), the entropy bonus,
    the KL loss to the reference (``use_kl_loss``), over ``ppo_epochs`` x mini-batches."""

    name: ClassVar[str] = "ppo"
    metric_names: ClassVar[StepMetricNames] = StepMetricNames("actor/grad_norm", "actor/nonfinite_skipped",
                                                              "actor/lr")
    temperature_from_batch: ClassVar[bool] = True

    def columns(self, batch: Any, cfg: Any) -> list[str]:
        """On-policy updates (one epoch of one mini-batch) may omit ``old_log_probs``: the policy has not
        moved since the rollout, so the update's own log-probs, detached, are the old ones (verl's
        ``on_policy`` branch), saving the separate forward of ``compute_log_prob``."""
        on_policy = cfg.ppo_epochs == 1 and len(batch["responses"]) <= cfg.ppo_mini_batch_size
        has_old = "old_log_probs" in batch
        if not has_old and not on_policy:
            raise KeyError(f"update_policy needs 'old_log_probs' unless the update is on-policy (ppo_epochs=1 and "
                           f"one mini-batch); got ppo_epochs={cfg.ppo_epochs}, {len(batch['responses'])} responses "
                           f"and ppo_mini_batch_size={cfg.ppo_mini_batch_size}")
        keys = [*LOGPROB_KEYS, "advantages"] + (["old_log_probs"] if has_old else [])
        keys += ["ref_log_prob"] if cfg.use_kl_loss else []
        keys += [k for k in ("response_mask", "rollout_is_weights") if k in batch]
        keys += ["rollout_log_probs"] if "rollout_log_probs" in batch and not has_old else []
        return keys

    def loop(self, cfg: Any, rows: int) -> UpdateLoop:
        return ppo_loop(cfg, shared_prefix=bool(cfg.use_prefix_grouper))

    def entropy(self, cfg: Any) -> tuple[bool, bool]:
        return True, cfg.entropy_coeff != 0

    def loss(self, log_prob, entropy, mb, info, meter, cfg):
        mode, mask = cfg.loss_agg_mode, response_mask_of(mb)
        info = with_loss_scale_factor(info, cfg)
        pg_loss, pg_metrics = get_policy_loss_fn(cfg.policy_loss.loss_mode)(
            old_log_prob=mb["old_log_probs"] if "old_log_probs" in mb else log_prob.detach(), log_prob=log_prob,
            advantages=mb["advantages"], response_mask=mask, loss_agg_mode=mode,
            config=ConfigWithBatchInfo(cfg, info), rollout_is_weights=mb.get("rollout_is_weights"))
        entropy_agg = agg_loss(entropy, mask, mode, **info)
        loss = pg_loss - cfg.entropy_coeff * entropy_agg if cfg.entropy_coeff != 0 else pg_loss
        if cfg.use_kl_loss:
            kl = agg_loss(kl_penalty(log_prob, mb["ref_log_prob"], cfg.kl_loss_type), mask, mode, **info)
            loss = loss + cfg.kl_loss_coef * kl
            meter.add("actor/kl_loss", kl)
        share = float(mask.sum()) / max(info["batch_num_tokens"], 1.0)  # token share of the mini-batch
        meter.add("actor/pg_loss", pg_loss)
        meter.add("actor/entropy", entropy_agg)
        if "old_log_probs" not in mb and "rollout_log_probs" in mb:  # on-policy: no separate pass measured the gap
            gap = (mb["rollout_log_probs"].exp() - log_prob.detach().float().exp()).abs()
            meter.add("training/rollout_actor_probs_diff_mean", masked_mean(gap, mask.float()), share)
        for name, value in pg_metrics.items():
            meter.add(name, value, share)
        return loss

    def finish(self, metrics, cfg):
        if cfg.use_kl_loss:
            metrics["actor/kl_coef"] = cfg.kl_loss_coef


@dataclass(frozen=True)
class SFT(Objective):
    """Token-mean negative log-likelihood of the ``response_mask`` tokens over the WHOLE batch of all
    ranks: one optimizer step per call (verl's SFT loss)."""

    name: ClassVar[str] = "sft"
    metric_names: ClassVar[StepMetricNames] = StepMetricNames("train/grad_norm", "train/nonfinite_skipped",
                                                              "train/lr")

    def loss(self, log_prob, entropy, mb, info, meter, cfg):
        loss = agg_loss(-log_prob, mb["response_mask"].to(log_prob.dtype), "token-mean", **info)
        meter.add("train/loss", loss)
        return loss


class _PairObjective(Objective):
    """Rows come in pairs, chosen at even rows and rejected at the odd row after it, sharing their
    prompt; ``pair_weight`` ``[N]`` is 1 for real pairs and 0 for the padding pairs that give every rank
    as many pairs (`posttrain.distributed.split.pad_pairs`). The loss is the mean over all pairs of
    all ranks; metrics use TRL's names, each micro-batch adding its share of the mean over all pairs."""

    metric_names: ClassVar[StepMetricNames] = StepMetricNames("grad_norm", "nonfinite_skipped", "learning_rate")
    pairs: ClassVar[bool] = True
    extra_columns: ClassVar[tuple[str, ...]] = ()

    def columns(self, batch: Any, cfg: Any) -> list[str]:
        rows = len(batch["responses"])
        if rows % 2:
            raise ValueError(f"a {self.name} update needs chosen/rejected pairs (an even number of rows), got {rows}")
        return [*LOGPROB_KEYS, "response_mask", "pair_weight", *self.extra_columns]

    def loop(self, cfg: Any, rows: int) -> UpdateLoop:
        return UpdateLoop(micro_batch_size=max(1, int(cfg.ppo_micro_batch_size_per_gpu)), grad_clip=cfg.grad_clip,
                          pairs=self.pairs)

    def normalisers(self, data):
        """``scale``: world size / pairs over all ranks (FSDP averages gradients over ranks)."""
        pairs, world = summed_over_ranks(data["pair_weight"][0::2].sum())
        return {"scale": world / max(float(pairs), 1.0)}

    def pair_losses(self, sums: torch.Tensor, lengths: torch.Tensor, ref: torch.Tensor | None):
        """``(losses, chosen_rewards, rejected_rewards, chosen_logps, rejected_logps)``, each ``[B]``, from
        each row's summed log-prob ``sums`` ``[2B]``, response-token count ``lengths`` ``[2B]`` and the
        reference's summed log-probs ``ref`` ``[2B]`` (None when the objective has no reference)."""
        raise NotImplementedError

    def loss(self, log_prob, entropy, mb, info, meter, cfg):
        chosen, rejected, chosen_len, rejected_len = pair_logps(log_prob, mb["response_mask"])
        sums = torch.stack([chosen, rejected], 1).flatten()
        lengths = torch.stack([chosen_len, rejected_len], 1).flatten()
        ref = mb["ref_logps"].to(sums.dtype) if "ref_logps" in mb else None
        losses, chosen_rewards, rejected_rewards, chosen_logps, rejected_logps = self.pair_losses(sums, lengths, ref)
        weight = mb["pair_weight"][0::2].to(losses.dtype)
        loss = (losses * weight).sum() * info["scale"] + self.extra_loss(log_prob, mb, info, meter)
        meter.add("loss", loss.detach())
        real = weight > 0  # padding pairs (weight 0) count in the metrics no more than in the loss
        stats = dpo_metrics(chosen_rewards[real], rejected_rewards[real], chosen_logps[real], rejected_logps[real])
        for name, mean in stats.items():  # this micro-batch's share of the mean over all ranks' pairs
            meter.add(name, mean * int(real.sum()) * info["scale"] if bool(real.any()) else 0.0)
        return loss

    def extra_loss(self, log_prob, mb, info, meter) -> torch.Tensor | float:
        return 0.0


@dataclass(frozen=True)
class DPO(_PairObjective):
    """`posttrain.algorithms.dpo.dpo_loss` (TRL's DPOTrainer semantics) against the reference's summed
    log-probs ``ref_logps`` ``[N]``; ``ipo`` averages by each response's token count."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    name: ClassVar[str] = "dpo"
    needs_reference: ClassVar[bool] = True
    extra_columns: ClassVar[tuple[str, ...]] = ("ref_logps",)

    def pair_losses(self, sums, lengths, ref):
        chosen, rejected = sums[0::2], sums[1::2]
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            chosen, rejected, ref[0::2], ref[1::2], beta=self.beta, loss_type=self.loss_type,
            label_smoothing=self.label_smoothing, chosen_lengths=lengths[0::2], rejected_lengths=lengths[1::2])
        return losses, chosen_rewards, rejected_rewards, chosen, rejected


@dataclass(frozen=True)
class SimPO(_PairObjective):
    """SimPO (https://arxiv.org/abs/2405.14734) with TRL's ``CPOTrainer(loss_type="simpo")`` semantics:
    no reference model; the margin is between length-averaged log-probs,
    ``-log sigmoid(beta (avg_c - avg_r) - simpo_gamma)`` (cDPO-style ``label_smoothing``), plus
    ``cpo_alpha`` x the token-mean NLL of the chosen responses (CPO-SimPO; 0 is SimPO itself)."""

    beta: float = 2.0
    simpo_gamma: float = 0.5
    cpo_alpha: float = 0.0
    label_smoothing: float = 0.0
    name: ClassVar[str] = "simpo"

    def normalisers(self, data):
        """Also the chosen responses' tokens over all ranks (the NLL term's token mean)."""
        weight = data["pair_weight"][0::2].to(torch.float64)
        chosen_tokens = (data["response_mask"][0::2].sum(-1).to(torch.float64) * weight).sum()
        totals, world = summed_over_ranks(torch.stack([weight.sum(), chosen_tokens]))
        return {"scale": world / max(float(totals[0]), 1.0), "chosen_token_scale": world / max(float(totals[1]), 1.0)}

    def pair_losses(self, sums, lengths, ref):
        average = sums / lengths.to(sums.dtype).clamp(min=1)
        chosen, rejected = average[0::2], average[1::2]
        losses, chosen_rewards, rejected_rewards = simpo_loss(chosen, rejected, beta=self.beta, gamma=self.simpo_gamma,
                                                              label_smoothing=self.label_smoothing)
        return losses, chosen_rewards, rejected_rewards, chosen, rejected

    def extra_loss(self, log_prob, mb, info, meter):
        if not self.cpo_alpha:
            return 0.0
        chosen_mask = mb["response_mask"][0::2].to(log_prob.dtype) * mb["pair_weight"][0::2, None].to(log_prob.dtype)
        nll = -(log_prob[0::2] * chosen_mask).sum() * info["chosen_token_scale"]
        meter.add("nll_loss", nll.detach())
        return self.cpo_alpha * nll


@dataclass(frozen=True)
class Distill(PPO):
    """On-policy distillation (verl 0.9.1's ``distillation_ppo_loss``, `posttrain.algorithms.distillation`): the
    teacher's scores of the sampled tokens (``teacher_log_probs``; ``teacher_topk_ids`` /
    ``teacher_topk_log_probs`` for a top-k mode) against the student's, as a supervised divergence or, with
    ``use_policy_gradient``, as per-token advantages of the PPO loss; plus the task rewards' PPO loss (the
    actor's own keys: policy loss, entropy bonus, KL loss) when ``use_task_rewards``. The knobs are
    ``distillation.distillation_loss.*``; `from_config` reads them."""

    loss_mode: str = "k3"
    topk: int | None = None
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: float | None = None
    log_prob_min_clamp: float | None = None
    use_policy_gradient: bool = False
    policy_loss_mode: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = 0.2
    clip_ratio_high: float | None = 0.2
    name: ClassVar[str] = "distill"

    @classmethod
    def from_config(cls, loss: Any) -> "Distill":
        """From a ``distillation.distillation_loss`` section."""
        keys = ("loss_mode", "topk", "use_task_rewards", "distillation_loss_coef", "loss_max_clamp", "log_prob_min_clamp",
                "use_policy_gradient", "policy_loss_mode", "clip_ratio", "clip_ratio_low", "clip_ratio_high")
        return cls(**{key: getattr(loss, key) for key in keys})

    @property
    def uses_topk(self) -> bool:
        return distillation_loss_spec(self.loss_mode).use_topk

    def gathered_ids(self) -> str | None:
        return "teacher_topk_ids" if self.uses_topk else None

    def columns(self, batch: Any, cfg: Any) -> list[str]:
        keys = super().columns(batch, cfg) + ["teacher_log_probs"]
        return keys + (["teacher_topk_ids", "teacher_topk_log_probs"] if self.uses_topk else [])

    def loss(self, log_prob, entropy, mb, info, meter, cfg):
        mask = response_mask_of(mb)
        scores = DistillationScores(log_prob, mb["teacher_log_probs"], mask, mb.get("student_topk_log_probs"),
                                    mb.get("teacher_topk_log_probs"), mb.get("teacher_topk_ids"),
                                    mb.get("student_topk_ids"))
        losses, token_metrics = distillation_token_losses(self.loss_mode, scores, self.log_prob_min_clamp)
        old = mb["old_log_probs"] if "old_log_probs" in mb else log_prob.detach()
        distill, loss_metrics = distillation_loss(
            losses, mask, cfg.loss_agg_mode, loss_max_clamp=self.loss_max_clamp,
            use_policy_gradient=self.use_policy_gradient, log_prob=log_prob, old_log_prob=old,
            policy_loss_mode=self.policy_loss_mode, policy_config=self, rollout_is_weights=mb.get("rollout_is_weights"),
            global_batch_info=info)
        # verl computes the task rewards' PPO loss also under policy gradient alone (its metrics), then drops it
        policy = super().loss(log_prob, entropy, mb, info, meter, cfg) if (
            self.use_task_rewards or self.use_policy_gradient) else 0.0
        total = combine_with_policy_loss(distill, policy, use_task_rewards=self.use_task_rewards,
                                         distillation_loss_coef=self.distillation_loss_coef)
        share = float(mask.sum()) / max(info["batch_num_tokens"], 1.0)  # token share of the mini-batch
        meter.add("distillation/loss", distill)  # each micro-batch's part of the mini-batch's loss: a sum
        means = {**token_metrics, **loss_metrics, **sampled_token_metrics(log_prob, mb["teacher_log_probs"], mask)}
        for name, value in means.items():
            if not name.endswith(("_min", "_max")):  # a sum over micro-batches cannot hold a min or a max
                meter.add(name, value, share)
        return total

