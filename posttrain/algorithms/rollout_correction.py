"""Rollout correction (`algorithm.rollout_correction.*`), verl 0.9 semantics and metric names.

The rollout engine (vLLM in bf16, say) samples from a policy that is not exactly the trainer's:
``log r = old_log_prob - rollout_log_prob`` per token is the gap. Two remedies, usable together:

- importance sampling (``rollout_is``): truncated weights ``min(r, threshold)`` that multiply the
  per-token policy loss, per token (``token``) or one weight per response, the product of its
  token ratios (``sequence``);
- rejection sampling (``rollout_rs``): tokens or whole responses whose divergence statistic is out
  of bounds leave ``response_mask``. Statistics: ``k1 = -log r`` (two-sided ratio bounds),
  ``k2 = (log r)^2 / 2``, ``k3 = r - 1 - log r`` (upper bound), per token (``token_k*``) or as a
  response's sum, mean or max (``seq_sum_k*``, ``seq_mean_k*``, ``seq_max_k*``); several options
  separated by commas must all pass.

Both are registries (``register_rollout_is``, ``register_rollout_rs``), like the estimators and
losses. Log-ratios are clamped to +-20 before exponentiating. Metrics are floats named
``rollout_corr/<name>`` as verl names them (``rollout_is_mean``, ``rollout_rs_masked_fraction``,
``kl``, ``chi2_token``...). ``bypass_mode`` (rollout log-probs serve as the old log-probs, and the
old-log-prob pass is skipped) is applied by the trainer; see `uses_bypass_mode`.

Shapes: ``[N, R]`` for log-probs, masks and weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from posttrain.algorithms.utils import masked_mean, masked_sum

__all__ = [
    "SAFETY_BOUND",
    "apply_rollout_correction",
    "check_rollout_correction_config",
    "offpolicy_metrics",
    "register_rollout_is",
    "register_rollout_rs",
    "registered_rollout_is",
    "registered_rollout_rs",
    "rollout_is_weights",
    "rollout_rejection_mask",
    "uses_bypass_mode",
]

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to [-20, 20] before ``exp`` (weights within about 2e-9 .. 4.9e8)."""

# ---------------------------------------------------------------------------------------------
# registries

IsLevelFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(log_ratio, mask) -> (per-token weights before truncation [N, R], log-ratio the metrics use)."""
RsStatFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, "torch.Tensor | None"]]
"""(log_ratio, mask) -> (per-token statistic [N, R], per-response statistic [N] or None for token level)."""

_IS_LEVELS: dict[str, IsLevelFn] = {}
_RS_OPTIONS: dict[str, RsStatFn] = {}


def _register(table: dict, kind: str, name: str):
    def decorator(fn):
        existing = table.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"{kind} {name!r} is already registered to {existing.__qualname__}")
        table[name] = fn
        return fn

    return decorator


def register_rollout_is(name: str):
    """Decorator registering an importance-weight aggregation level (``rollout_is=name``)."""
    return _register(_IS_LEVELS, "rollout_is level", name)


def register_rollout_rs(name: str):
    """Decorator registering a rejection statistic (``rollout_rs=name``); names ending in ``k1``
    take two-sided ratio bounds, the others an upper bound."""
    return _register(_RS_OPTIONS, "rollout_rs option", name)


def registered_rollout_is() -> tuple[str, ...]:
    return tuple(sorted(_IS_LEVELS))


def registered_rollout_rs() -> tuple[str, ...]:
    return tuple(sorted(_RS_OPTIONS))


def _safe(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)


@register_rollout_is("token")
def _is_token(log_ratio, mask):
    return torch.exp(_safe(log_ratio)), log_ratio


@register_rollout_is("sequence")
def _is_sequence(log_ratio, mask):
    total = masked_sum(log_ratio, mask, axis=-1).unsqueeze(-1)  # [N, 1]: log of the product of ratios
    return torch.exp(_safe(total)).expand_as(log_ratio), total


def _k1(lr):
    return -_safe(lr)


def _k2(lr):
    return 0.5 * _safe(lr) ** 2


def _k3(lr):
    s = _safe(lr)
    return torch.exp(s) - 1.0 - s


def _seq_max(values, mask):
    filled = values.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(torch.isinf(filled), torch.zeros_like(filled), filled)


def _make_rs(stat, reduce):
    def fn(log_ratio, mask):
        per_token = stat(log_ratio)
        if reduce is None:
            return per_token, None
        return per_token, reduce(per_token, mask)
    return fn


for _k, _stat in (("k1", _k1), ("k2", _k2), ("k3", _k3)):
    register_rollout_rs(f"token_{_k}")(_make_rs(_stat, None))
    register_rollout_rs(f"seq_sum_{_k}")(_make_rs(_stat, lambda v, m: masked_sum(v, m, axis=-1)))
    register_rollout_rs(f"seq_mean_{_k}")(_make_rs(_stat, lambda v, m: masked_mean(v, m, axis=-1)))
    if _k != "k1":
        register_rollout_rs(f"seq_max_{_k}")(_make_rs(_stat, _seq_max))

# ---------------------------------------------------------------------------------------------
# importance weights


def rollout_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str = "token", threshold: float = 2.0,
                       batch_normalize: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights ``[N, R]`` (0 on padding, detached) and their metrics.

    Metrics describe the weights before truncation at ``threshold`` (``rollout_is_mean``,
    ``_max``, ``_min``, ``_ratio_fraction_high`` above ``threshold``, ``_ratio_fraction_low`` below
    ``1/threshold``, ``_std`` and ``_eff_sample_size`` of the weights clipped to
    ``[1/threshold, threshold]``, and ``rollout_is_seq_*`` of the per-response mean weight).
    ``batch_normalize`` divides the truncated weights by their mean (token level: over tokens;
    sequence level: over responses) and reports it as ``rollout_is_batch_norm_factor``.
    """
    if level not in _IS_LEVELS:
        raise ValueError(f"unknown rollout_is {level!r}; registered: {registered_rollout_is()}")
    if threshold <= 0:
        raise ValueError(f"rollout_is_threshold must be positive, got {threshold}")
    mask = mask.to(log_ratio.dtype)
    weights, metric_log_ratio = _IS_LEVELS[level](log_ratio, mask)
    weights = weights * mask
    metrics = _is_metrics(weights, metric_log_ratio, mask, level, threshold)
    weights = weights.clamp(max=threshold).detach()
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, mask)
        else:
            per_seq = masked_mean(weights, mask, axis=-1)
            valid = (mask.sum(-1) > 0).to(weights.dtype)
            mean = (per_seq * valid).sum() / valid.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = float(mean)
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def _is_metrics(weights, metric_log_ratio, mask, level, threshold) -> dict[str, float]:
    lower = 1.0 / threshold
    out: dict[str, float] = {"rollout_is_mean": float(masked_mean(weights, mask))}
    if level == "sequence":
        out["rollout_is_max"] = math.exp(min(float(metric_log_ratio.max()), SAFETY_BOUND))
        out["rollout_is_min"] = math.exp(float(metric_log_ratio.min()))
        out["rollout_is_ratio_fraction_high"] = float((metric_log_ratio > math.log(threshold)).float().mean())
        out["rollout_is_ratio_fraction_low"] = float((metric_log_ratio < math.log(lower)).float().mean())
    else:
        out["rollout_is_ratio_fraction_high"] = float(masked_mean((weights > threshold).float(), mask))
        out["rollout_is_ratio_fraction_low"] = float(masked_mean((weights < lower).float(), mask))
        out["rollout_is_max"] = float(weights.masked_fill(~mask.bool(), float("-inf")).max())
        out["rollout_is_min"] = float(weights.masked_fill(~mask.bool(), float("inf")).min())
    clipped = weights.clamp(min=lower, max=threshold)
    out["rollout_is_std"] = _masked_std(clipped, mask) if mask.sum() > 1 else 0.0
    normalized = clipped / (masked_mean(clipped, mask) + 1e-8)
    out["rollout_is_eff_sample_size"] = 1.0 / float(masked_mean(normalized.square(), mask))
    per_seq = masked_mean(weights, mask, axis=-1)
    out.update({
        "rollout_is_seq_mean": float(per_seq.mean()),
        "rollout_is_seq_std": float(per_seq.std()) if per_seq.numel() > 1 else 0.0,
        "rollout_is_seq_max": float(per_seq.max()),
        "rollout_is_seq_min": float(per_seq.min()),
        "rollout_is_seq_max_deviation": float((per_seq - 1.0).abs().max()),
        "rollout_is_seq_fraction_high": float((per_seq > threshold).float().mean()),
        "rollout_is_seq_fraction_low": float((per_seq < lower).float().mean()),
    })
    return out


def _masked_std(values, mask) -> float:
    """Population std over masked elements (``E[x^2] - E[x]^2``, floored at 0)."""
    mean = masked_mean(values, mask)
    var = masked_mean(values.square(), mask) - mean.square()
    return float(torch.sqrt(var.clamp(min=0.0)))

# ---------------------------------------------------------------------------------------------
# rejection


def _parse_thresholds(options: list[str], spec: Any) -> dict[str, tuple[float | None, float]]:
    """``rollout_rs_threshold`` -> {option: (lower ratio bound or None, upper bound)}.

    One value is shared by all options, or one per option (comma separated). ``k1`` options take
    ``"lower_upper"`` ratio bounds, or one number ``u`` meaning ``1/u .. u``; the others one upper bound.
    """
    if spec is None:
        raise ValueError("rollout_rs needs algorithm.rollout_correction.rollout_rs_threshold")
    parts = [str(spec)] if isinstance(spec, (int, float)) else [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(parts) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold has {len(parts)} values for {len(options)} rollout_rs options; "
                         "give one shared value or one per option")
    parts = parts * len(options) if len(parts) == 1 else parts
    out: dict[str, tuple[float | None, float]] = {}
    for option, part in zip(options, parts):
        try:
            if option.endswith("k1"):
                lo, hi = (float(x) for x in part.split("_", 1)) if "_" in part else (1.0 / float(part), float(part))
            elif "_" in part:
                raise ValueError(f"rollout_rs_threshold {part!r} for {option}: one upper bound, no '_'")
            else:
                lo, hi = None, float(part)
        except ValueError as err:
            raise ValueError(f"rollout_rs_threshold {part!r} for {option} is not a number: {err}") from err
        if hi <= 0 or (lo is not None and lo <= 0):
            raise ValueError(f"rollout_rs_threshold for {option} must be positive, got {part!r}")
        out[option] = (lo, hi)
    return out


def _rs_options(rollout_rs: str) -> list[str]:
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    unknown = [o for o in options if o not in _RS_OPTIONS]
    if not options or unknown:
        raise ValueError(f"unknown rollout_rs option(s) {unknown or rollout_rs!r}; registered: {registered_rollout_rs()}")
    return options


def rollout_rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, rollout_rs: str,
                           threshold: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """``mask`` with rejected tokens (or whole responses) set to 0, and the rejection metrics.

    A token is kept when every option keeps it: ``k1`` statistics within ``[log lower, log upper]``,
    the others at most the upper bound; a sequence-level option keeps or drops a response whole.
    """
    options = _rs_options(rollout_rs)
    bounds = _parse_thresholds(options, threshold)
    fmask = mask.to(log_ratio.dtype)
    valid_seq = fmask.sum(-1) > 0
    keep_all = torch.ones_like(fmask)
    metrics: dict[str, float] = {}
    for option in options:
        per_token, per_seq = _RS_OPTIONS[option](log_ratio, fmask)
        lo, hi = bounds[option]
        two_sided = option.endswith("k1")
        upper, lower = (math.log(hi), math.log(lo)) if two_sided else (hi, 0.0)
        values = per_token if per_seq is None else per_seq
        keep = (values <= upper) & (values >= lower) if two_sided else values <= upper
        if per_seq is not None:
            keep = keep.unsqueeze(-1).expand_as(fmask)
            per_token = per_seq.unsqueeze(-1).expand_as(fmask)
        keep_f = keep.to(fmask.dtype)
        keep_all = keep_all * keep_f
        metrics.update(_rs_metrics(option, per_token, per_seq, fmask, valid_seq, upper, lower, two_sided))
        seq_kept = ~((~keep) & fmask.bool()).any(-1)
        metrics[f"rollout_rs_{option}_masked_fraction"] = float(masked_mean(1 - keep_f, fmask))
        n_valid = valid_seq.float().sum()
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            float(((~seq_kept).float() * valid_seq.float()).sum() / n_valid) if n_valid > 0 else 0.0)
    metrics["rollout_rs_masked_fraction"] = float(masked_mean(1 - keep_all, fmask))
    rejected_any = ((keep_all <= 0.5) & fmask.bool()).any(-1)
    metrics["rollout_rs_seq_masked_fraction"] = float(rejected_any.float().mean())
    return (mask * keep_all).to(mask.dtype), metrics


def _rs_metrics(option, per_token, per_seq, mask, valid_seq, upper, lower, two_sided) -> dict[str, float]:
    p = f"rollout_rs_{option}"
    seq_values = (per_seq if per_seq is not None else masked_mean(per_token, mask, axis=-1))[valid_seq]
    sequence_level = per_seq is not None and seq_values.numel() > 0
    out = {f"{p}_mean": float(masked_mean(per_token, mask))}
    if sequence_level:
        out[f"{p}_max"], out[f"{p}_min"] = float(seq_values.max()), float(seq_values.min())
        out[f"{p}_fraction_high"] = float((seq_values > upper).float().mean())
        out[f"{p}_fraction_low"] = float((seq_values < lower).float().mean()) if two_sided else 0.0
    else:
        out[f"{p}_max"] = float(per_token.masked_fill(~mask.bool(), float("-inf")).max())
        out[f"{p}_min"] = float(per_token.masked_fill(~mask.bool(), float("inf")).min())
        out[f"{p}_fraction_high"] = float(masked_mean((per_token > upper).float(), mask))
        out[f"{p}_fraction_low"] = float(masked_mean((per_token < lower).float(), mask)) if two_sided else 0.0
    clamped = per_token.clamp(min=lower if two_sided else 0.0, max=upper)
    out[f"{p}_std"] = _masked_std(clamped, mask) if mask.sum() > 1 else 0.0
    if seq_values.numel() > 0:
        out.update({
            f"{p}_seq_mean": float(seq_values.mean()),
            f"{p}_seq_std": float(seq_values.std()) if seq_values.numel() > 1 else 0.0,
            f"{p}_seq_max": float(seq_values.max()),
            f"{p}_seq_min": float(seq_values.min()),
            f"{p}_seq_max_deviation": float(seq_values.abs().max()),
            f"{p}_seq_fraction_high": float((seq_values > upper).float().mean()),
        })
        if two_sided:
            out[f"{p}_seq_fraction_low"] = float((seq_values < lower).float().mean())
    else:
        out.update({f"{p}_seq_{k}": 0.0 for k in ("mean", "std", "max", "min", "max_deviation", "fraction_high",
                                                   "fraction_low")})
    return out

# ---------------------------------------------------------------------------------------------
# diagnostics and the whole correction


def offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                      mask: torch.Tensor) -> dict[str, float]:
    """Trainer-vs-engine mismatch: ``kl`` (E[log p_rollout - log p_old]), ``k3_kl``, per-response
    perplexities (``training_ppl``, ``rollout_ppl`` and their logs, ``log_ppl_diff*``, ``ppl_ratio``),
    ``chi2_token`` (E[r^2] - 1) and ``chi2_seq`` (E[(prod r)^2] - 1)."""
    mask = mask.to(old_log_prob.dtype)
    mean_old = masked_mean(old_log_prob, mask, axis=-1)
    mean_rollout = masked_mean(rollout_log_prob, mask, axis=-1)
    log_ratio = old_log_prob - rollout_log_prob
    diff = mean_rollout - mean_old
    seq_log_ratio = _safe(masked_sum(log_ratio, mask, axis=-1))
    return {
        "training_ppl": float(torch.exp(-mean_old).mean()),
        "training_log_ppl": float((-mean_old).mean()),
        "kl": float(masked_mean(rollout_log_prob - old_log_prob, mask)),
        "k3_kl": float(masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask)),
        "rollout_ppl": float(torch.exp(-mean_rollout).mean()),
        "rollout_log_ppl": float((-mean_rollout).mean()),
        "log_ppl_diff": float(diff.mean()),
        "log_ppl_abs_diff": float(diff.abs().mean()),
        "log_ppl_diff_max": float(diff.max()),
        "log_ppl_diff_min": float(diff.min()),
        "ppl_ratio": float(torch.exp(diff).mean()),
        "chi2_token": float(masked_mean(torch.exp(_safe(log_ratio)).square(), mask) - 1.0),
        "chi2_seq": float(torch.exp(2.0 * seq_log_ratio).mean() - 1.0),
    }


def apply_rollout_correction(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                             config: Any) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(importance weights or None, response mask after rejection, ``rollout_corr/*`` metrics).

    ``config``: ``algorithm.rollout_correction`` (``rollout_is``, ``rollout_is_threshold``,
    ``rollout_is_batch_normalize``, ``rollout_rs``, ``rollout_rs_threshold``). With neither IS nor
    RS set the mask is returned unchanged and only the off-policy diagnostics are computed.
    """
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(f"shapes differ: old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
                         f"{tuple(rollout_log_prob.shape)}, response_mask {tuple(response_mask.shape)}")
    if not bool(response_mask.any()):
        return None, response_mask, {}
    log_ratio = (old_log_prob - rollout_log_prob).float()
    metrics: dict[str, float] = {}
    weights = None
    if config.rollout_is is not None:
        weights, m = rollout_is_weights(log_ratio, response_mask, config.rollout_is, float(config.rollout_is_threshold),
                                        bool(config.rollout_is_batch_normalize))
        metrics.update(m)
    mask = response_mask
    if config.rollout_rs is not None:
        mask, m = rollout_rejection_mask(log_ratio, response_mask, config.rollout_rs, config.rollout_rs_threshold)
        metrics.update(m)
    metrics.update(offpolicy_metrics(old_log_prob.float(), rollout_log_prob.float(), response_mask))
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def uses_bypass_mode(config: Any) -> bool:
    """``algorithm.rollout_correction.bypass_mode``: old log-probs are the rollout's, no recompute."""
    return bool(getattr(config, "bypass_mode", False))


def check_rollout_correction_config(config: Any, calculate_log_probs: bool) -> None:
    """ValueError naming the key when ``algorithm.rollout_correction`` cannot run as set."""
    p = "algorithm.rollout_correction"
    wants = config.rollout_is is not None or config.rollout_rs is not None or config.bypass_mode
    if wants and not calculate_log_probs:
        raise ValueError(f"{p} needs the engine's log-probs: set actor_rollout_ref.rollout.calculate_log_probs=true")
    if config.rollout_is is not None and config.rollout_is not in _IS_LEVELS:
        raise ValueError(f"{p}.rollout_is={config.rollout_is!r}; valid: null, {', '.join(registered_rollout_is())}")
    if config.rollout_is is not None and float(config.rollout_is_threshold) <= 0:
        raise ValueError(f"{p}.rollout_is_threshold must be positive, got {config.rollout_is_threshold}")
    if config.rollout_rs is not None:
        _parse_thresholds(_rs_options(config.rollout_rs), config.rollout_rs_threshold)
    if config.loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(f"{p}.loss_type={config.loss_type!r}; valid: ppo_clip, reinforce")
    if config.bypass_mode and config.loss_type != "ppo_clip":
        raise ValueError(f"{p}.loss_type=reinforce (bypass REINFORCE with explicit weights) is not implemented; "
                         "use loss_type=ppo_clip")
    if config.bypass_mode and (config.rollout_is is not None or config.rollout_rs is not None):
        raise ValueError(f"{p}.bypass_mode=true with rollout_is/rollout_rs is not implemented (verl applies them "
                         "inside the loss against the current policy); use bypass_mode=false to correct with "
                         "recomputed old log-probs, or drop rollout_is/rollout_rs")
