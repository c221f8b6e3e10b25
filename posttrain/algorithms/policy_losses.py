"""Policy-gradient losses, registered by name (`actor.policy_loss.loss_mode`), verl 0.9 semantics.

Every loss has one signature::

    pg_loss, metrics = fn(old_log_prob, log_prob, advantages, response_mask,
                          loss_agg_mode="token-mean", config=actor_cfg, rollout_is_weights=None)

old_log_prob, log_prob, advantages, response_mask, rollout_is_weights: `[batch, response_len]`.
`config` is the actor section: `clip_ratio`, `clip_ratio_low`, `clip_ratio_high`, `clip_ratio_c`,
`policy_loss.{clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio, ppo_kl_coef, dro_beta}`, `tau_pos`,
`tau_neg`, `policy_loss.rollout_correction` (bypass_mode), and optionally `global_batch_info` (a dict of
`agg_loss` normalisers: dp_size, batch_num_tokens, global_batch_size, loss_scale_factor). Metrics are
detached 0-dim tensors under verl's names (`actor/pg_clipfrac`, `actor/ppo_kl`, `actor/pg_clipfrac_lower`); the caller reduces
them once per step. `rollout_is_weights`, when given, multiplies the per-token losses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.algorithms.losses import agg_loss
from posttrain.algorithms.utils import config_value, masked_mean

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class PolicyLossSpec:
    """A policy loss's registration: its function, the `actor_rollout_ref.actor` keys it reads beyond
    the PPO ones, and a one-line summary (`posttrain diff` shows it)."""

    name: str
    fn: PolicyLossFn
    keys: tuple[str, ...] = ()
    summary: str = "a registered policy loss"
    positive: tuple[str, ...] = ()
    """Keys among `keys` that must be set and > 0 (the config check refuses null or <= 0)."""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.fn(*args, **kwargs)


POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}
"""The one registry, as verl has it: name -> the registered function. A function placed straight into
it (as verl users do) is a loss like a decorated one, reading no extra keys."""

_DECLARED: dict[str, PolicyLossSpec] = {}
"""What `register_policy_loss` was told about each name's function; it describes the registry's entry
only while that entry is still the same function."""


def register_policy_loss(name: str, *, keys: tuple[str, ...] = (), summary: str = "a registered policy loss",
                         positive: tuple[str, ...] = ()) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under `name` with what it reads and does (`PolicyLossSpec`);
    verl's one-argument form works too. The same function again is accepted; a different function
    under a taken name raises ValueError (verl would replace the loss silently)."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        existing = POLICY_LOSS_REGISTRY.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"policy loss {name!r} is already registered to "
                             f"{getattr(existing, '__qualname__', existing)!r}, not {fn.__qualname__}")
        POLICY_LOSS_REGISTRY[name] = fn
        _DECLARED[name] = PolicyLossSpec(name, fn, tuple(keys), summary, tuple(positive))
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The function registered under `name` (the registry's entry itself); ValueError listing the
    valid names otherwise."""
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"unknown policy loss mode {name!r}; registered: {registered_policy_losses()}")
    return POLICY_LOSS_REGISTRY[name]


def policy_loss_spec(name: str) -> PolicyLossSpec:
    """The registration of `name`: its function and the keys it declared (none, for a function placed
    straight into the registry); ValueError listing the valid names otherwise."""
    fn = get_policy_loss_fn(name)
    declared = _DECLARED.get(name)
    return declared if declared is not None and declared.fn is fn else PolicyLossSpec(name, fn)


def registered_policy_losses() -> tuple[str, ...]:
    """Names of all registered policy losses, sorted."""
    return tuple(sorted(POLICY_LOSS_REGISTRY))


# ---------------------------------------------------------------------------------------------
# helpers


def _clip_range(config: Any) -> tuple[float, float]:
    """(low, high) PPO clip epsilons; each falls back to `clip_ratio` when None."""
    clip_ratio = config_value(config, "clip_ratio")
    low = config_value(config, "clip_ratio_low", None)
    high = config_value(config, "clip_ratio_high", None)
    return (clip_ratio if low is None else low), (clip_ratio if high is None else high)


def _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights) -> torch.Tensor:
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    global_info = config_value(config, "global_batch_info", None) or {}
    return agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **global_info)


def _policy_loss_option(config: Any, name: str, default: float) -> float:
    value = config_value(config_value(config, "policy_loss"), name, None)
    return default if value is None else value


def _metrics(**values: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"actor/{name}": value.detach() for name, value in values.items()}


# ---------------------------------------------------------------------------------------------
# losses


@register_policy_loss("vanilla", keys=("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c"),
                      summary="PPO clipped surrogate (asymmetric DAPO clip, dual clip)")
def compute_policy_loss_vanilla(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """PPO clipped surrogate (https://arxiv.org/abs/1707.06347) with asymmetric clips (DAPO
    clip-higher, https://arxiv.org/abs/2503.14476) and dual clip (https://arxiv.org/abs/1912.09729):

    r = exp(clamp(logp - old_logp, -20, 20));  L1 = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high));
    L = min(L1, -A c) where A < 0, else L1   (c = clip_ratio_c > 1, default 3).
    """
    low, high = _clip_range(config)
    clip_ratio_c = config_value(config, "clip_ratio_c", 3.0)
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip lower bound) must be > 1.0, got {clip_ratio_c}")

    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), response_mask)

    loss_dual = -advantages * clip_ratio_c
    pg_clipfrac_lower = masked_mean(torch.gt(loss_ppo, loss_dual) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, torch.min(loss_dual, loss_ppo), loss_ppo)

    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)


@register_policy_loss("gspo", keys=("clip_ratio", "clip_ratio_low", "clip_ratio_high"),
                      summary="GSPO: a sequence-level (geometric-mean) importance ratio, clipped")
def compute_policy_loss_gspo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="seq-mean-token-mean",
    config=None,
    rollout_is_weights=None,
):
    """GSPO, https://arxiv.org/abs/2507.18071: sequence-level ratio s_i = exp(mean_t(logp - old_logp))
    used per token as s_{i,t} = sg[s_i] * pi / sg[pi] (log clamped at 10), then PPO clipping.
    pg_clipfrac_lower is always 0.
    """
    low, high = _clip_range(config)
    log_ratio = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    seq_log_ratio = torch.sum(log_ratio * response_mask, dim=-1) / seq_lengths  # [batch]

    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))

    loss_unclipped = -advantages * seq_ratio
    loss_clipped = -advantages * torch.clamp(seq_ratio, 1 - low, 1 + high)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)
    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)

    pg_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), response_mask)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    zero = torch.tensor(0.0, device=pg_loss.device)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=zero)


@register_policy_loss("gpg", summary="GPG: plain policy gradient, -A log p, no ratio or clip")
def compute_policy_loss_gpg(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """GPG, https://arxiv.org/abs/2504.02546: plain policy gradient -logp * A (no ratio, no clip, no metrics)."""
    pg_loss = _aggregate(-log_prob * advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, {}


@register_policy_loss("clip_cov", keys=("clip_ratio", "clip_ratio_low", "clip_ratio_high", "policy_loss.clip_cov_ratio",
                            "policy_loss.clip_cov_lb", "policy_loss.clip_cov_ub"),
                      summary="Clip-Cov: PPO clip plus no gradient for a fraction of high-covariance tokens")
def compute_policy_loss_clip_cov(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """Clip-Cov, https://arxiv.org/abs/2505.22617: PPO clip, plus the gradient of a random
    `clip_cov_ratio` share of tokens whose centred cov(A, logp) lies in (clip_cov_lb, clip_cov_ub)
    (and that PPO did not already clip) is cut. The ratio is not clamped here (as in verl).
    The random choice uses `torch.randperm` with the global generator, exactly as verl does.
    """
    low, high = _clip_range(config)
    cov_ratio = _policy_loss_option(config, "clip_cov_ratio", 0.0002)
    cov_lb = _policy_loss_option(config, "clip_cov_lb", 1.0)
    cov_ub = _policy_loss_option(config, "clip_cov_ub", 5.0)
    if not cov_ratio > 0:
        raise ValueError(f"policy_loss.clip_cov_ratio must be > 0, got {cov_ratio}")

    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)

    with torch.no_grad():
        valid = response_mask > 0
        clipped_by_ppo = (loss_clipped > loss_unclipped) & valid
        logp = log_prob.detach()
        cov = (advantages - masked_mean(advantages, response_mask)) * (logp - masked_mean(logp, response_mask))
        cov = cov.masked_fill(~valid | clipped_by_ppo, -torch.inf)
        n_clip = max(int(cov_ratio * response_mask.sum().item()), 1)
        candidates = torch.nonzero((cov < cov_ub) & (cov > cov_lb) & valid)  # [n, 2]
        if len(candidates) > 0:
            candidates = candidates[torch.randperm(len(candidates))[: min(n_clip, len(candidates))]]
        keep = torch.ones_like(advantages)
        keep[candidates[:, 0], candidates[:, 1]] = 0

    pg_clipfrac = masked_mean((keep == 0).float(), response_mask)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped) * keep
    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl)


@register_policy_loss("kl_cov", keys=("policy_loss.kl_cov_ratio", "policy_loss.ppo_kl_coef"),
                      summary="KL-Cov: a KL penalty on a fraction of high-covariance tokens")
def compute_policy_loss_kl_cov(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """KL-Cov, https://arxiv.org/abs/2505.22617: unclipped -A r, plus ppo_kl_coef * |logp - old_logp|
    on the top `kl_cov_ratio` share of valid tokens by centred cov(A, logp) (at least one token).
    Metric `actor/ppo_kl` is the masked mean of |logp - old_logp|.
    """
    kl_cov_ratio = _policy_loss_option(config, "kl_cov_ratio", 0.0002)
    ppo_kl_coef = _policy_loss_option(config, "ppo_kl_coef", 1.0)
    if not kl_cov_ratio > 0:
        raise ValueError(f"policy_loss.kl_cov_ratio must be > 0, got {kl_cov_ratio}")

    log_ratio = log_prob - old_log_prob
    abs_kl = log_ratio.abs()
    ratio = torch.exp(log_ratio)
    ppo_kl_abs = masked_mean(abs_kl, response_mask)
    loss_plain = -advantages * ratio
    loss_with_kl = -advantages * ratio + ppo_kl_coef * abs_kl

    with torch.no_grad():
        valid = response_mask > 0
        flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
        adv = advantages[valid].detach().reshape(-1).cpu()
        logp = log_prob[valid].detach().reshape(-1).cpu()
        selected = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        if len(adv) > 0:
            cov = (adv - adv.mean()) * (logp - logp.mean())
            top = torch.topk(cov, max(1, int(len(cov) * kl_cov_ratio)), largest=True).indices
            selected[flat_valid[top.to(flat_valid.device)]] = True
        selected = selected.view_as(valid)

    pg_losses = torch.where(selected, loss_with_kl, loss_plain)
    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, _metrics(ppo_kl=ppo_kl_abs)


@register_policy_loss("geo_mean", keys=("clip_ratio", "clip_ratio_low", "clip_ratio_high"),
                      summary="GMPO: geometric mean of clipped token ratios")
def compute_policy_loss_geo_mean(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """GMPO, https://arxiv.org/abs/2507.20673: per sequence, ratio = exp(mean_t of the sign(A)-wise
    clipped log-ratio), loss = -mean_t(A) * ratio, averaged over sequences (`loss_agg_mode` unused).
    rollout_is_weights enter as their per-sequence geometric mean.
    """
    low, high = _clip_range(config)
    log_ratio = log_prob - old_log_prob
    ppo_kl = masked_mean(-log_ratio, response_mask)

    sign = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, -low, high)
    log_ratio_min = sign * torch.min(sign * log_ratio, sign * log_ratio_clamped)

    lengths = response_mask.sum(dim=-1)  # [batch]
    seq_ratio = torch.exp((log_ratio_min * response_mask).sum(dim=-1) / (lengths + 1e-8))
    seq_adv = (advantages * response_mask).sum(dim=-1) / (lengths + 1e-8)
    pg_losses = -seq_adv * seq_ratio  # [batch]
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights + 1e-10) * response_mask
        pg_losses = pg_losses * torch.exp(log_w.sum(dim=-1) / (lengths + 1e-8))
    pg_loss = torch.mean(pg_losses)

    clipped = torch.ne(log_ratio, log_ratio_clamped)
    pg_clipfrac = masked_mean((clipped * (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = masked_mean((clipped * (advantages < 0)).float(), response_mask)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)


@register_policy_loss("cispo", keys=("clip_ratio", "clip_ratio_low", "clip_ratio_high"),
                      summary="CISPO: clipped, stop-gradient importance weights times log p")
def compute_policy_loss_cispo(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """CISPO, https://arxiv.org/abs/2506.13585: -sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * logp."""
    low, high = _clip_range(config)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    clipped_ratio = torch.clamp(ratio, 1 - low, 1 + high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    pg_clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)
    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    zero = torch.tensor(0.0, device=pg_loss.device)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=zero)


@register_policy_loss("sapo", keys=("tau_pos", "tau_neg"),
                      summary="SAPO: soft, temperature-controlled gating of the ratio instead of a hard clip")
def compute_policy_loss_sapo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="seq-mean-token-mean",
    config=None,
    rollout_is_weights=None,
):
    """SAPO, https://arxiv.org/abs/2511.20347: soft gate f(r) = sigmoid(tau (r - 1)) * 4 / tau with
    tau = tau_pos where A > 0 else tau_neg; loss -f(r) * A, always aggregated seq-mean-token-mean
    (as verl does, whatever `loss_agg_mode` says). Clip fractions are reported as 0.
    """
    tau_pos = torch.as_tensor(config_value(config, "tau_pos"), dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(config_value(config, "tau_neg"), dtype=advantages.dtype, device=advantages.device)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_loss = _aggregate(-gate * advantages, response_mask, "seq-mean-token-mean", config, rollout_is_weights)
    zero = torch.tensor(0.0, device=pg_loss.device)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, _metrics(pg_clipfrac=zero, ppo_kl=ppo_kl, pg_clipfrac_lower=zero)


def _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
               trusted: torch.Tensor):
    """DPPO's shared part: ``trusted`` (bool ``[batch, response_len]``) says where the update stays inside
    the divergence bound; the loss is -A * sg[min(r, clip_ratio_c)] * logp there and 0 elsewhere."""
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    # truncated importance sampling (not dual clip); the paper advises a large bound (its section 5.4)
    clip_ratio_c = config_value(config, "clip_ratio_c", 20.0)
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    valid = trusted.detach().float()
    pg_losses = -advantages * truncated * log_prob * valid
    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    pg_clipfrac = masked_mean(1.0 - valid, response_mask)
    pg_clipfrac_lower = masked_mean((ratio > clip_ratio_c).float() * valid, response_mask)  # truncated share
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)


@register_policy_loss("dppo_tv", keys=("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c"),
                      summary="DPPO-TV: a token stops giving gradient once pi - pi_old passes the clip bound in "
                              "its advantage's direction; ratio truncated at clip_ratio_c")
def compute_policy_loss_dppo_tv(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """DPPO, binary total variation, https://arxiv.org/abs/2602.04879: the trust region is on the
    probability itself, not the ratio. A token takes part where A > 0 and pi - pi_old <= clip_ratio_high,
    or A <= 0 and pi - pi_old >= -clip_ratio_low (the clip keys are divergence bounds here); its loss is
    -A * sg[min(r, clip_ratio_c)] * logp. pg_clipfrac: share of tokens left out; pg_clipfrac_lower: share
    of kept tokens whose ratio was truncated.
    """
    low, high = _clip_range(config)
    change = torch.exp(log_prob) - torch.exp(old_log_prob)
    trusted = torch.where(advantages > 0, change <= high, change >= -low)
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                      trusted)


@register_policy_loss("dppo_kl", keys=("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c"),
                      summary="DPPO-KL: a token stops giving gradient once the binary KL(pi_old || pi) passes "
                              "the clip bound in its advantage's direction; ratio truncated at clip_ratio_c")
def compute_policy_loss_dppo_kl(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """DPPO, binary KL, https://arxiv.org/abs/2602.04879: with p = pi(token), q = pi_old(token),
    KL = q log(q / p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8)). A token takes part where it moves
    against its advantage's direction (A > 0 and p <= q, or A <= 0 and p >= q) or KL stays within
    clip_ratio_high (A > 0) / clip_ratio_low (A <= 0); the loss is then as in `dppo_tv`.
    """
    low, high = _clip_range(config)
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    trusted = torch.where(advantages > 0, (binary_kl <= high) | (prob <= old_prob),
                          (binary_kl <= low) | (prob >= old_prob))
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                      trusted)


@register_policy_loss("dro", keys=("policy_loss.dro_beta",), positive=("policy_loss.dro_beta",),
                      summary="DRO: -A log p plus a quadratic penalty beta/2 (log p - log p_old)^2 (dro_beta > 0)")
def compute_policy_loss_dro(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """Direct Reward Optimization (https://arxiv.org/abs/2405.19107) as verl has it: per token
    -(A logp - beta / 2 * (logp - old_logp)^2) with beta = ``policy_loss.dro_beta`` (> 0, ValueError
    otherwise). Metric: ``actor/ppo_kl``.
    """
    beta = _policy_loss_option(config, "dro_beta", None)
    if beta is None or not beta > 0:
        raise ValueError(f"policy_loss.dro_beta must be > 0 with loss_mode=dro, got {beta}")
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    pg_loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, _metrics(ppo_kl=masked_mean(-log_ratio, response_mask))


@register_policy_loss("bypass_mode", keys=("policy_loss.rollout_correction",),
                      summary="bypass mode: the rollout's log-probs are the old ones; PPO clip, or REINFORCE with "
                              "importance weights, after rejection (rollout_correction)")
def compute_policy_loss_bypass_mode(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """verl's bypass-mode loss: ``old_log_prob`` is the rollout engine's. Importance weights and rejection
    (``policy_loss.rollout_correction``: ``rollout_is``, ``rollout_is_threshold``,
    ``rollout_is_batch_normalize``, ``rollout_rs``, ``rollout_rs_threshold``, ``loss_type``) are taken of
    the *current* policy against the rollout's, without gradient (`rollout_correction`); then
    ``loss_type=ppo_clip``: `vanilla` on the kept tokens, the weights unused (the ratio already is the
    correction); ``reinforce``: -w * A * logp on the kept tokens, metric ``actor/ppo_kl`` of the rollout
    policy against the current one. ``rollout_is_weights`` is ignored (they are computed here).
    Metrics add ``rollout_corr/*`` (floats).
    """
    from posttrain.algorithms.rollout_correction import apply_rollout_correction

    correction = _policy_loss_option(config, "rollout_correction", None)
    if correction is None:
        raise ValueError("loss_mode=bypass_mode needs policy_loss.rollout_correction (verl's trainer puts "
                         "algorithm.rollout_correction there when rollout_correction.bypass_mode=true)")
    loss_type = config_value(correction, "loss_type", "ppo_clip")
    with torch.no_grad():
        weights, kept, corr_metrics = apply_rollout_correction(log_prob.detach(), old_log_prob, response_mask,
                                                               _CorrectionDefaults(correction))
    if loss_type == "reinforce":
        pg_losses = -advantages * log_prob * (weights if weights is not None else 1.0)
        pg_loss = _aggregate(pg_losses, kept, loss_agg_mode, config, None)
        metrics = _metrics(ppo_kl=masked_mean(-(log_prob - old_log_prob), kept))
    elif loss_type == "ppo_clip":
        pg_loss, metrics = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, kept, loss_agg_mode, config)
    else:
        raise ValueError(f"rollout_correction.loss_type={loss_type!r}; valid: ppo_clip, reinforce")
    return pg_loss, {**metrics, **corr_metrics}


class _CorrectionDefaults:
    """A rollout-correction section read with verl's defaults for the keys it may leave out."""

    DEFAULTS = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
                "rollout_rs": None, "rollout_rs_threshold": None}

    def __init__(self, section: Any):
        self._section = section

    def __getattr__(self, name: str) -> Any:
        return config_value(self.__dict__["_section"], name, self.DEFAULTS[name])
