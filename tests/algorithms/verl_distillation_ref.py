"""verl 0.9.1's distillation losses, transcribed as the reference our functions are compared with, so the
comparison runs where verl is not installed (CI). Copyright 2025 Bytedance Ltd. and/or its affiliates,
Apache License 2.0 (verl's licence). Sources, in the 0.9.1 wheel:

  verl/trainer/distillation/fsdp/losses.py   compute_forward_kl_topk, kl_divergence (the logits processor)
  verl/trainer/distillation/losses.py        compute_forward_kl_topk (registered), the estimator loss,
                                             distillation_loss, distillation_ppo_loss
  verl/trainer/ppo/core_algos.py             kl_penalty_forward, agg_loss, compute_policy_loss_vanilla

Only what ties them to verl's runtime is left out: nested/packed tensors (every tensor here is padded
``[B, R(, K)]``), Ulysses slicing, the ``Metric`` wrappers and ``.item()`` (values stay tensors).
`tests/algorithms/test_distillation_loss.py` also runs verl's own code where an unpacked wheel is named
by ``POSTTRAIN_VERL_SRC``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F


def masked_sum(values, mask, axis=None):
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def masked_mean(values, mask, axis=None):
    s = masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


def kl_penalty_forward(logprob, ref_logprob, kl_penalty):
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = ref_logprob - logprob
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        return torch.clamp(kld, min=-10, max=10)
    raise NotImplementedError


def agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
             loss_scale_factor=None):
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        loss = masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    elif loss_agg_mode == "token-sum":
        loss = masked_sum(loss_mat, loss_mask) * dp_size
    elif loss_agg_mode in ["seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            if loss_scale_factor is None:
                loss_scale_factor = loss_mask.shape[-1]
            loss /= loss_scale_factor
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    return loss


def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, rollout_is_weights=None):
    clip_ratio = config.clip_ratio
    clip_ratio_low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
    clip_ratio_high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio
    clip_ratio_c = getattr(config, "clip_ratio_c", 3.0)  # DistillationLossConfig has none: config.get(.., 3.0)
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                       **config.global_batch_info)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": ppo_kl,
                     "actor/pg_clipfrac_lower": pg_clipfrac_lower}


# ------------------------------------------------------------------ verl/trainer/distillation/fsdp/losses.py


def kl_divergence(log_q, log_p):
    log_p = log_p.float()
    log_q = log_q.float()
    p = log_p.exp()
    kld = p * (log_p - log_q)
    return kld.sum(dim=-1)


def fsdp_compute_forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, log_prob_min_clamp):
    """The logits processor on padded ``[B, R, V]`` logits (the default, not-chunked path)."""
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    student_topk_ids = torch.topk(student_log_probs, k=teacher_topk_ids.shape[-1], dim=-1).indices
    student_topk_log_probs = torch.gather(student_log_probs, dim=-1, index=teacher_topk_ids)
    student_mass = student_topk_log_probs.exp().sum(dim=-1)
    teacher_mass = teacher_topk_log_probs.exp().sum(dim=-1)
    if log_prob_min_clamp is not None:
        student_topk_log_probs = student_topk_log_probs.clamp_min(log_prob_min_clamp)
        teacher_topk_log_probs = teacher_topk_log_probs.clamp_min(log_prob_min_clamp)
    distillation_losses = kl_divergence(log_q=student_topk_log_probs, log_p=teacher_topk_log_probs)
    overlap_mask = (teacher_topk_ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(dim=-1)
    overlap_count = overlap_mask.sum(dim=-1)
    token_kl = teacher_topk_log_probs.exp() * (teacher_topk_log_probs - student_topk_log_probs)
    overlap_token_advantage_sum = (-token_kl * overlap_mask).sum(dim=-1)
    overlap_token_advantage = overlap_token_advantage_sum / overlap_count.clamp_min(1)
    overlap_token_advantage = torch.where(overlap_count > 0, overlap_token_advantage,
                                          torch.zeros_like(overlap_token_advantage))
    return {"distillation_losses": distillation_losses, "student_mass": student_mass, "teacher_mass": teacher_mass,
            "overlap_count": overlap_count, "overlap_token_advantage": overlap_token_advantage,
            "student_topk_ids": student_topk_ids}


# ------------------------------------------------------------------ verl/trainer/distillation/losses.py


def compute_forward_kl_topk(model_output, response_mask, topk):
    distillation_losses = model_output["distillation_losses"]
    response_mask_bool = response_mask.bool()
    overlap_count, overlap_token_advantage = model_output["overlap_count"], model_output["overlap_token_advantage"]
    valid_overlap_count = overlap_count[response_mask_bool]
    overlap_metrics = {"distillation/overlap_ratio": valid_overlap_count.float().mean() / topk}
    overlap_position_mask = response_mask_bool & (overlap_count > 0)
    overlap_metrics["distillation/overlap_token_advantage"] = (
        overlap_token_advantage[overlap_position_mask].mean() if overlap_position_mask.any()
        else torch.tensor(0.0))
    student_mass = model_output["student_mass"][response_mask_bool]
    teacher_mass = model_output["teacher_mass"][response_mask_bool]
    metrics = {
        "distillation/student_mass": student_mass.mean(),
        "distillation/student_mass_min": student_mass.min(),
        "distillation/student_mass_max": student_mass.max(),
        "distillation/teacher_mass": teacher_mass.mean(),
        "distillation/teacher_mass_min": teacher_mass.min(),
        "distillation/teacher_mass_max": teacher_mass.max(),
        **overlap_metrics,
    }
    return distillation_losses.clamp_min(0.0), metrics


def compute_distillation_loss_reverse_kl_estimator(student_log_probs, teacher_log_probs, response_mask, loss_mode):
    losses = kl_penalty_forward(logprob=student_log_probs, ref_logprob=teacher_log_probs, kl_penalty=loss_mode)
    return losses, {"distillation/abs_loss": losses[response_mask.bool()].abs().mean()}


def distillation_loss(losses, metrics, response_mask, loss_agg_mode, loss_config, global_batch_info, log_prob=None,
                      old_log_prob=None, rollout_is_weights=None):
    """verl's ``distillation_loss`` after the registered loss function has run (``losses``, ``metrics``)."""
    valid = losses[response_mask.bool()]
    metrics = dict(metrics)
    metrics["distillation/loss_min"] = valid.min()
    metrics["distillation/loss_max"] = valid.max()
    if loss_config.loss_max_clamp is not None:
        losses = losses.clamp(min=-loss_config.loss_max_clamp, max=loss_config.loss_max_clamp)
    if loss_config.use_policy_gradient:
        config = SimpleNamespace(clip_ratio=loss_config.clip_ratio, clip_ratio_low=loss_config.clip_ratio_low,
                                 clip_ratio_high=loss_config.clip_ratio_high, global_batch_info=global_batch_info)
        loss, pg_metrics = compute_policy_loss_vanilla(old_log_prob=old_log_prob, log_prob=log_prob,
                                                       advantages=-losses.detach(), response_mask=response_mask,
                                                       loss_agg_mode=loss_agg_mode, config=config,
                                                       rollout_is_weights=rollout_is_weights)
        metrics.update({f"distillation/{k[len('actor/'):]}": v for k, v in pg_metrics.items()})
    else:
        loss = agg_loss(loss_mat=losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **global_batch_info)
    return loss, metrics


def distillation_ppo_loss(distill_loss, ppo_loss, loss_config):
    """The combination in verl's ``distillation_ppo_loss`` (``ppo_loss``: verl's ``ppo_loss`` of the task rewards)."""
    if not loss_config.use_task_rewards and not loss_config.use_policy_gradient:
        policy_loss = 0.0
    else:
        policy_loss = ppo_loss
        if not loss_config.use_task_rewards:
            policy_loss = 0.0
    coef = loss_config.distillation_loss_coef if loss_config.use_task_rewards else 1.0
    return policy_loss + distill_loss * coef
