"""On-policy distillation losses (verl 0.9.1's ``distillation.distillation_loss.loss_mode``), registered by name.

The student samples, the teacher scores the student's tokens, and the student learns from that dense,
per-token signal on the states it visits (https://thinkingmachines.ai/blog/on-policy-distillation/;
GKD, https://arxiv.org/abs/2306.13649). Shapes: ``B`` responses, ``R`` response length, ``K`` top-k.

Per-token losses ``[B, R]`` (`distillation_token_losses`, dispatched by the registry):

    k1 / kl         log s - log t                            (s: student, t: teacher, on the sampled token)
    abs             |log s - log t|
    k2 / mse        0.5 (log s - log t)^2
    k3 / low_var_kl t/s - log(t/s) - 1, log(t/s) clamped to [-20, 20], result to [-10, 10]
                    (the single-sample reverse-KL estimators of `posttrain.algorithms.kl.kl_penalty`,
                    with the teacher in the reference's place)
    forward_kl_topk sum_k p_t(k) (log p_t(k) - log p_s(k)) over the teacher's top-k tokens, both log-probs
                    clamped below at ``log_prob_min_clamp`` (after the top-k masses are measured), the
                    result clamped at 0 (the top-k masses do not sum to 1, so it can be negative)

Then (`distillation_loss`): the per-token losses are clamped to ``[-loss_max_clamp, loss_max_clamp]``, and
either aggregated as a supervised loss (``agg_loss``), or, with ``use_policy_gradient``, fed as per-token
advantages ``-loss`` (detached) to the registered policy loss (``vanilla`` PPO clip) with the distillation
section's clip ratios. `combine_with_policy_loss` adds the task-reward PPO loss when ``use_task_rewards``.
Metric values are detached tensors; the caller reduces them once per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.algorithms.kl import kl_penalty
from posttrain.algorithms.losses import agg_loss
from posttrain.algorithms.policy_losses import get_policy_loss_fn
from posttrain.algorithms.utils import masked_mean

__all__ = [
    "ESTIMATOR_LOSS_MODES",
    "DistillationLossSpec",
    "DistillationScores",
    "combine_with_policy_loss",
    "distillation_loss",
    "distillation_loss_spec",
    "distillation_token_losses",
    "forward_kl_topk",
    "get_distillation_loss_fn",
    "register_distillation_loss",
    "registered_distillation_losses",
    "sampled_token_metrics",
    "topk_log_probs",
    "topk_overlap",
]

ESTIMATOR_LOSS_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
"""verl's single-sample reverse-KL estimator modes (their names in `posttrain.algorithms.kl`)."""


@dataclass(frozen=True)
class DistillationScores:
    """What a loss mode reads, per response token (``[B, R]``; top-k tensors ``[B, R, K]``; None where absent).

    student_log_probs: the student's log-probs of the sampled tokens (differentiable in training).
    teacher_log_probs: the teacher's log-probs of the same tokens.
    response_mask: 1 on valid response tokens.
    student_topk_log_probs: the student's log-probs of the teacher's top-k tokens (differentiable).
    teacher_topk_log_probs, teacher_topk_ids: the teacher's top-k tokens, highest first, and their log-probs.
    student_topk_ids: the student's own top-k tokens (the overlap diagnostics only).
    """

    student_log_probs: torch.Tensor | None
    teacher_log_probs: torch.Tensor | None
    response_mask: torch.Tensor
    student_topk_log_probs: torch.Tensor | None = None
    teacher_topk_log_probs: torch.Tensor | None = None
    teacher_topk_ids: torch.Tensor | None = None
    student_topk_ids: torch.Tensor | None = None


TokenLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class DistillationLossSpec:
    """A loss mode's registration: its function and what it reads (verl's ``DistillationLossSettings``):
    ``use_topk`` (the teacher's top-k tokens and log-probs) or ``use_estimator`` (the sampled tokens' log-probs)."""

    name: str
    fn: TokenLossFn
    use_topk: bool = False
    use_estimator: bool = False


_REGISTRY: dict[str, DistillationLossSpec] = {}


def register_distillation_loss(*names: str, use_topk: bool = False,
                               use_estimator: bool = False) -> Callable[[TokenLossFn], TokenLossFn]:
    """Decorator registering a per-token loss ``fn(scores, loss_mode, log_prob_min_clamp) -> (losses [B, R],
    metrics)`` under every name of ``names``; exactly one of ``use_topk`` / ``use_estimator``. A taken name
    raises ValueError (as verl's registry does)."""
    if use_topk == use_estimator:
        raise ValueError(f"a distillation loss uses the teacher's top-k or a single-sample estimator, exactly one; "
                         f"got use_topk={use_topk}, use_estimator={use_estimator}")

    def decorator(fn: TokenLossFn) -> TokenLossFn:
        for name in names:
            if name in _REGISTRY:
                raise ValueError(f"distillation loss {name!r} is already registered "
                                 f"(to {_REGISTRY[name].fn.__qualname__})")
        for name in names:
            _REGISTRY[name] = DistillationLossSpec(name, fn, use_topk, use_estimator)
        return fn

    return decorator


def distillation_loss_spec(name: str) -> DistillationLossSpec:
    """The registration of loss mode ``name``; ValueError listing the valid modes otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown distillation loss mode {name!r}; registered: {registered_distillation_losses()}")
    return _REGISTRY[name]


def get_distillation_loss_fn(name: str) -> TokenLossFn:
    return distillation_loss_spec(name).fn


def registered_distillation_losses() -> tuple[str, ...]:
    """Every registered loss mode, sorted."""
    return tuple(sorted(_REGISTRY))


# ------------------------------------------------------------------------------------------ per-token losses


def topk_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)`` at ``ids``: logits ``[..., V]``, ids ``[..., K]`` -> ``[..., K]`` (in float32 at least)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return torch.log_softmax(logits, dim=-1, dtype=dtype).gather(-1, ids.long())


def forward_kl_topk(student_topk_log_probs: torch.Tensor, teacher_topk_log_probs: torch.Tensor,
                    log_prob_min_clamp: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(kl, student_mass, teacher_mass)``, each ``[B, R]``, from log-probs ``[B, R, K]`` of the teacher's top-k
    tokens: ``kl = sum_k p_t (log p_t - log p_s)`` in float32 after both are clamped below at
    ``log_prob_min_clamp``; the masses ``sum_k exp(log p)`` are measured before the clamp (verl's FSDP path).
    Not clamped at 0 here: `distillation_token_losses` does that, as verl's registered loss does."""
    student_mass = student_topk_log_probs.exp().sum(dim=-1)
    teacher_mass = teacher_topk_log_probs.exp().sum(dim=-1)
    if log_prob_min_clamp is not None:
        student_topk_log_probs = student_topk_log_probs.clamp_min(log_prob_min_clamp)
        teacher_topk_log_probs = teacher_topk_log_probs.clamp_min(log_prob_min_clamp)
    log_p, log_q = teacher_topk_log_probs.float(), student_topk_log_probs.float()
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    return kl, student_mass, teacher_mass


def topk_overlap(teacher_topk_ids: torch.Tensor, student_topk_ids: torch.Tensor, teacher_topk_log_probs: torch.Tensor,
                 student_topk_log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's overlap diagnostics (arXiv:2604.13016): per token, how many of the teacher's top-k tokens are
    in the student's top-k (``[B, R]`` ints), and the mean of ``-p_t (log p_t - log p_s)`` over those
    (``[B, R]``, 0 where there are none). Log-probs as the loss saw them (after the clamp)."""
    overlap = (teacher_topk_ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(dim=-1)  # [B, R, K]
    count = overlap.sum(dim=-1)
    token_kl = teacher_topk_log_probs.exp() * (teacher_topk_log_probs - student_topk_log_probs)
    advantage = (-token_kl * overlap).sum(dim=-1) / count.clamp_min(1)
    return count, torch.where(count > 0, advantage, torch.zeros_like(advantage))


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return values[mask.bool()]


def _min_max(name: str, values: torch.Tensor) -> dict[str, torch.Tensor]:
    if values.numel() == 0:
        zero = values.new_zeros(())
        return {f"{name}_min": zero, f"{name}_max": zero}
    return {f"{name}_min": values.min().detach(), f"{name}_max": values.max().detach()}


@register_distillation_loss("forward_kl_topk", use_topk=True)
def forward_kl_topk_loss(scores: DistillationScores, loss_mode: str,
                         log_prob_min_clamp: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward KL(teacher || student) over the teacher's top-k tokens (`forward_kl_topk`), clamped at 0, with
    the masses of both distributions on those tokens (and the overlap diagnostics when the student's own
    top-k ids are given)."""
    if scores.student_topk_log_probs is None or scores.teacher_topk_log_probs is None:
        raise ValueError("loss_mode forward_kl_topk needs the student's and the teacher's top-k log-probs")
    kl, student_mass, teacher_mass = forward_kl_topk(scores.student_topk_log_probs, scores.teacher_topk_log_probs,
                                                     log_prob_min_clamp)
    mask = scores.response_mask
    s_mass, t_mass = _masked(student_mass, mask).detach(), _masked(teacher_mass, mask).detach()
    metrics = {"distillation/student_mass": s_mass.mean() if s_mass.numel() else s_mass.new_zeros(()),
               **_min_max("distillation/student_mass", s_mass),
               "distillation/teacher_mass": t_mass.mean() if t_mass.numel() else t_mass.new_zeros(()),
               **_min_max("distillation/teacher_mass", t_mass)}
    if scores.student_topk_ids is not None and scores.teacher_topk_ids is not None:
        clamp = (lambda x: x.clamp_min(log_prob_min_clamp)) if log_prob_min_clamp is not None else (lambda x: x)
        count, advantage = topk_overlap(scores.teacher_topk_ids, scores.student_topk_ids,
                                        clamp(scores.teacher_topk_log_probs),
                                        clamp(scores.student_topk_log_probs.detach()))
        k = scores.teacher_topk_ids.shape[-1]
        valid = _masked(count, mask).float()
        metrics["distillation/overlap_ratio"] = valid.mean() / k if valid.numel() else valid.new_zeros(())
        overlapped = mask.bool() & (count > 0)
        metrics["distillation/overlap_token_advantage"] = (advantage[overlapped].mean() if bool(overlapped.any())
                                                           else advantage.new_zeros(()))
    return kl.clamp_min(0.0), metrics


@register_distillation_loss(*ESTIMATOR_LOSS_MODES, use_estimator=True)
def reverse_kl_estimator_loss(scores: DistillationScores, loss_mode: str,
                              log_prob_min_clamp: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A single-sample estimate of the reverse KL(student || teacher) on each sampled token
    (`posttrain.algorithms.kl.kl_penalty` with the teacher as the reference); ``log_prob_min_clamp`` is not
    read (as in verl). Metric: the mean absolute loss (k1 can be negative)."""
    if scores.student_log_probs is None or scores.teacher_log_probs is None:
        raise ValueError(f"loss_mode {loss_mode} needs the student's and the teacher's log-probs of the sampled tokens")
    losses = kl_penalty(logprob=scores.student_log_probs, ref_logprob=scores.teacher_log_probs, kl_penalty=loss_mode)
    mask = scores.response_mask
    abs_loss = _masked(losses.detach(), mask).abs()
    return losses, {"distillation/abs_loss": abs_loss.mean() if abs_loss.numel() else abs_loss.new_zeros(())}


def distillation_token_losses(loss_mode: str, scores: DistillationScores,
                              log_prob_min_clamp: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The registered loss mode's per-token losses ``[B, R]`` and metrics (the registry is the only dispatch)."""
    return get_distillation_loss_fn(loss_mode)(scores, loss_mode, log_prob_min_clamp)


# ------------------------------------------------------------------------------------------ the loss


def distillation_loss(
    losses: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    loss_max_clamp: float | None = None,
    use_policy_gradient: bool = False,
    log_prob: torch.Tensor | None = None,
    old_log_prob: torch.Tensor | None = None,
    policy_loss_mode: str = "vanilla",
    policy_config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    global_batch_info: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's ``distillation_loss``: per-token ``losses`` ``[B, R]`` -> ``(scalar loss, metrics)``.

    The range of the losses before any clamp is logged (``distillation/loss_min``, ``_max``), then they are
    clamped to ``[-loss_max_clamp, loss_max_clamp]`` (the lower bound is for k1, which can be negative).
    Supervised (GKD): ``agg_loss(losses, response_mask, loss_agg_mode, **global_batch_info)``.
    ``use_policy_gradient``: the policy loss ``policy_loss_mode`` with ``advantages = -losses`` (detached),
    ratio ``exp(log_prob - old_log_prob)``, ``policy_config`` (clip_ratio, clip_ratio_low, clip_ratio_high;
    clip_ratio_c defaults to 3), its metrics under ``distillation/`` instead of ``actor/``.
    ``distillation/clamped_frac``: the share of valid tokens whose loss was outside the clamp.
    """
    mask = response_mask
    valid = _masked(losses.detach(), mask)
    metrics = _min_max("distillation/loss", valid)
    info = dict(global_batch_info or {})
    if loss_max_clamp is not None:
        outside = (valid.abs() > loss_max_clamp).float()
        metrics["distillation/clamped_frac"] = outside.mean() if outside.numel() else outside.new_zeros(())
        losses = losses.clamp(min=-loss_max_clamp, max=loss_max_clamp)
    else:
        metrics["distillation/clamped_frac"] = valid.new_zeros(())
    if not use_policy_gradient:
        return agg_loss(loss_mat=losses, loss_mask=mask, loss_agg_mode=loss_agg_mode, **info), metrics
    if log_prob is None or old_log_prob is None:
        raise ValueError("use_policy_gradient needs the student's log-probs and the old log-probs of the sampled tokens")
    config = _PolicyConfig(policy_config, info)
    loss, pg_metrics = get_policy_loss_fn(policy_loss_mode)(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=-losses.detach(), response_mask=mask,
        loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=rollout_is_weights)
    metrics.update({f"distillation/{k.removeprefix('actor/')}": v for k, v in pg_metrics.items()})
    return loss, metrics


class _PolicyConfig:
    """The distillation section's clip ratios as a policy loss reads them, with the batch normalisers."""

    def __init__(self, base: Any, info: dict[str, Any]):
        self._base, self.global_batch_info = base, info

    def __getattr__(self, name: str) -> Any:
        base = self.__dict__["_base"]
        if isinstance(base, dict):
            if name in base:
                return base[name]
            raise AttributeError(name)
        return getattr(base, name)


def combine_with_policy_loss(distill_loss: torch.Tensor, policy_loss: torch.Tensor | float, *, use_task_rewards: bool,
                             distillation_loss_coef: float) -> torch.Tensor:
    """verl's ``distillation_ppo_loss``: ``policy_loss + coef * distill_loss`` with the task rewards' PPO loss,
    ``distill_loss`` alone without them (the coefficient applies only beside task rewards)."""
    if not use_task_rewards:
        return distill_loss
    return policy_loss + distill_loss * distillation_loss_coef


def sampled_token_metrics(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                          response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """On the sampled tokens: the per-token reverse KL to the teacher (its k1 estimate, ``log s - log t``,
    averaged over valid tokens) and the mean log-probs of student and teacher."""
    s, t, m = student_log_probs.detach().float(), teacher_log_probs.detach().float(), response_mask.float()
    return {"distillation/reverse_kl": masked_mean(s - t, m), "distillation/student_log_prob": masked_mean(s, m),
            "distillation/teacher_log_prob": masked_mean(t, m)}
