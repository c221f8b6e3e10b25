"""DPO losses (`loss_type`), registered by name, with TRL's DPOTrainer semantics, and its metrics.

Inputs are *sequence* log-probs: each response's token log-probs summed over its response tokens
(end-of-turn token included, prompt and padding excluded), one value per pair, ``[B]``, for the
policy and for the reference. With ``h = (pi_c - ref_c) - (pi_r - ref_r)`` (the chosen log-ratio
minus the rejected one), ``beta`` and the label-smoothing ``eps``:

    sigmoid   -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)        DPO (eps = 0),
              conservative DPO for eps > 0 (https://ericmitchell.ai/cdpo.pdf)
    hinge     max(0, 1 - beta h)                                               SLiC-style hinge
    ipo       (h_avg - 1 / (2 beta))^2, h_avg from log-ratios divided by each response's token
              count (IPO, https://arxiv.org/abs/2310.12036, eq. 17; beta is the paper's tau)
    robust    (-(1 - eps) log sigmoid(beta h) + eps log sigmoid(-beta h)) / (1 - 2 eps)
              (rDPO, https://arxiv.org/abs/2403.00409; eps = the chance a label is flipped)

One reference-free loss sits beside them (`simpo_loss`, ``loss_type="simpo"``, TRL's ``CPOTrainer``):
with the policy's *length-averaged* log-probs ``a_c``, ``a_r`` and the margin ``gamma``,

    simpo     -(1 - eps) log sigmoid(beta (a_c - a_r) - gamma) - eps log sigmoid(-(beta (a_c - a_r) - gamma))

Rewards are the implicit ones, ``beta * (pi - ref)`` of the summed log-probs, detached (for every
loss type, IPO included).

Differences from TRL 1.16 (read from ``trl/trainer/dpo_trainer.py``, not copied):

- IPO's length normalisation: TRL divides each response's summed log-ratio by its completion
  token count inside the loss; so does :func:`dpo_loss`, which therefore needs ``chosen_lengths``
  and ``rejected_lengths`` for ``ipo`` (the callers keep passing *summed* log-probs).
- ``label_smoothing`` with ``sigmoid``: TRL 0.x (and OpenRLHF) apply it as conservative DPO; TRL
  1.x ignores it there. Here it is cDPO, so ``label_smoothing=0`` (the default) equals both.
- A ``label_smoothing`` given to a loss that does not use it (``hinge``, ``ipo``) is an error here,
  not ignored; ``robust`` needs ``0 <= eps < 0.5`` (TRL only warns; 0.5 divides by zero).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posttrain.errors import ConfigError

__all__ = ["DPO_LOSS_TYPES", "DPOLossSpec", "REFERENCE_FREE_LOSS_TYPES", "check_dpo_options", "check_simpo_options",
           "dpo_loss", "dpo_loss_spec", "dpo_metrics", "pair_logps", "register_dpo_loss", "registered_dpo_losses",
           "simpo_loss"]

REFERENCE_FREE_LOSS_TYPES = ("simpo",)
"""``dpo.loss_type`` values that compare the policy with itself: no reference model is loaded."""

DPOLossFn = Callable[..., torch.Tensor]
"""``fn(chosen_logratios [B], rejected_logratios [B], *, beta, label_smoothing, chosen_lengths,
rejected_lengths) -> losses [B]``; log-ratios are ``pi - ref`` of summed log-probs."""


@dataclass(frozen=True)
class DPOLossSpec:
    """A DPO loss's registration: its function, whether it reads ``label_smoothing`` and the response
    lengths, and a one-line summary."""

    name: str
    fn: DPOLossFn
    uses_label_smoothing: bool = False
    needs_lengths: bool = False
    summary: str = "a registered DPO loss"


_DPO_LOSSES: dict[str, DPOLossSpec] = {}


def register_dpo_loss(name: str, *, uses_label_smoothing: bool = False, needs_lengths: bool = False,
                      summary: str = "a registered DPO loss") -> Callable[[DPOLossFn], DPOLossFn]:
    """Decorator registering a DPO loss under ``name``; a different function under a taken name raises."""

    def decorator(fn: DPOLossFn) -> DPOLossFn:
        existing = _DPO_LOSSES.get(name)
        if existing is not None and existing.fn is not fn:
            raise ValueError(f"DPO loss {name!r} is already registered to {existing.fn.__qualname__}")
        _DPO_LOSSES[name] = DPOLossSpec(name, fn, uses_label_smoothing, needs_lengths, summary)
        return fn

    return decorator


def registered_dpo_losses() -> tuple[str, ...]:
    """Names of all registered DPO losses, sorted."""
    return tuple(sorted(_DPO_LOSSES))


def dpo_loss_spec(loss_type: str) -> DPOLossSpec:
    """The registration of ``loss_type``; ConfigError listing the valid names otherwise."""
    spec = _DPO_LOSSES.get(loss_type)
    if spec is None:
        raise ConfigError(f"dpo.loss_type={loss_type!r} is not a DPO loss; valid: {list(registered_dpo_losses())}")
    return spec


def check_dpo_options(*, beta: float, loss_type: str, label_smoothing: float = 0.0) -> DPOLossSpec:
    """Validate the DPO knobs (for config validation, before anything loads); returns the loss's spec.

    ConfigError naming the config key (``dpo.*``, where the DPO trainer reads these) and the value:
    an unknown ``loss_type``, ``beta <= 0``, a ``label_smoothing`` for a loss that ignores it, or one
    outside ``[0, 0.5)``. The DPO config's validation (`posttrain.config.sft_load`) calls it.
    """
    if loss_type not in _DPO_LOSSES and loss_type not in REFERENCE_FREE_LOSS_TYPES:
        valid = sorted([*registered_dpo_losses(), *REFERENCE_FREE_LOSS_TYPES])
        raise ConfigError(f"dpo.loss_type={loss_type!r} is not a DPO loss; valid: {valid}")
    spec = _SIMPO if loss_type == "simpo" else dpo_loss_spec(loss_type)
    if not beta > 0:
        raise ConfigError(f"dpo.beta={beta!r}: must be > 0 (TRL's default is 0.1)")
    if label_smoothing and not spec.uses_label_smoothing:
        users = [n for n in registered_dpo_losses() if _DPO_LOSSES[n].uses_label_smoothing]
        raise ConfigError(f"dpo.label_smoothing={label_smoothing!r} has no effect with dpo.loss_type={loss_type!r}; "
                          f"set it to 0, or use a loss that reads it: {users}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing={label_smoothing!r}: must be in [0, 0.5) (the chance that a "
                          "preference label is flipped; 0.5 would mean the labels carry no information)")
    return spec


def check_simpo_options(*, loss_type: str, simpo_gamma: float, cpo_alpha: float,
                        default_gamma: float, default_alpha: float) -> None:
    """``dpo.simpo_gamma`` and ``dpo.cpo_alpha``: finite, ``cpo_alpha >= 0``, and only set away from their
    defaults when ``dpo.loss_type=simpo`` (elsewhere they would silently do nothing)."""
    for key, value, default in (("simpo_gamma", simpo_gamma, default_gamma), ("cpo_alpha", cpo_alpha, default_alpha)):
        if not math.isfinite(value):
            raise ConfigError(f"dpo.{key}={value!r}: must be a finite number")
        if loss_type != "simpo" and value != default:
            raise ConfigError(f"dpo.{key}={value!r} has no effect with dpo.loss_type={loss_type!r}; it is read by "
                              f"dpo.loss_type=simpo only (leave it at {default})")
    if cpo_alpha < 0:
        raise ConfigError(f"dpo.cpo_alpha={cpo_alpha!r}: must be >= 0 (the weight of the chosen responses' NLL; "
                          "0 is SimPO, TRL's CPO default is 1.0)")


def simpo_loss(chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor, *, beta: float, gamma: float,
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair SimPO losses and rewards ``(losses [B], chosen_rewards [B], rejected_rewards [B])`` from
    the policy's length-averaged log-probs ``[B]`` (no reference). Rewards are ``beta x`` those
    averages, detached (TRL's CPO). Computed in float32 at least."""
    chosen, rejected = _at_least_float32(chosen_avg_logps), _at_least_float32(rejected_avg_logps)
    z = beta * (chosen - rejected) - gamma
    losses = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return losses, beta * chosen.detach(), beta * rejected.detach()


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str,
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO losses and implicit rewards: ``(losses [B], chosen_rewards [B], rejected_rewards [B])``.

    Every log-prob argument is ``[B]``: a response's token log-probs *summed* over its response
    tokens, for the policy (with gradients) and the reference (no gradients needed). ``ipo`` also
    needs ``chosen_lengths`` / ``rejected_lengths`` ``[B]``: each response's number of response
    tokens (its ``response_mask`` sum), by which it averages the log-ratios. The caller reduces
    ``losses`` (TRL: the mean over pairs). Computed in float32 at least; rewards are detached.
    """
    dpo_loss_spec(loss_type)  # a loss with a reference (simpo is `simpo_loss`)
    spec = check_dpo_options(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing)
    if spec.needs_lengths and (chosen_lengths is None or rejected_lengths is None):
        raise ValueError(f"DPO loss_type={loss_type!r} averages log-ratios per token: pass chosen_lengths and "
                         "rejected_lengths (response tokens of each response)")
    inputs = (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    policy_chosen, policy_rejected, ref_chosen, ref_rejected = (_at_least_float32(t) for t in inputs)
    chosen_logratios = policy_chosen - ref_chosen
    rejected_logratios = policy_rejected - ref_rejected
    losses = spec.fn(chosen_logratios, rejected_logratios, beta=beta, label_smoothing=label_smoothing,
                     chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def pair_logps(log_probs: torch.Tensor, response_mask: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths)``, each ``[B]``, from token
    log-probs ``[2B, R]`` of rows ordered ``chosen_0, rejected_0, chosen_1, ...`` (the layout of
    `posttrain.data.preference.collate_pairs`): log-probs summed over ``response_mask``, and the
    number of response tokens of each response (what ``ipo`` averages by)."""
    if log_probs.shape[0] % 2:
        raise ValueError(f"pair rows come two by two (chosen, rejected); got {log_probs.shape[0]} rows")
    mask = response_mask.to(log_probs.dtype)
    sums, lengths = (log_probs * mask).sum(-1), response_mask.sum(-1)
    return sums[0::2], sums[1::2], lengths[0::2], lengths[1::2]


def dpo_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, policy_chosen_logps: torch.Tensor,
                policy_rejected_logps: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's DPO metrics, each the mean over the ``B`` pairs given, as detached 0-dim tensors:
    ``rewards/{chosen,rejected,margins,accuracies}``, ``logps/{chosen,rejected}``.

    ``rewards/accuracies`` is the fraction of pairs whose chosen reward is strictly higher. Over
    several micro-batches, weight each one's values by its number of pairs.
    """
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "logps/chosen": policy_chosen_logps.detach().mean(),
        "logps/rejected": policy_rejected_logps.detach().mean(),
    }


def _at_least_float32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


# ---------------------------------------------------------------------------------------------
# losses


@register_dpo_loss("sigmoid", uses_label_smoothing=True,
                   summary="DPO: -log sigmoid(beta h); conservative DPO with label_smoothing")
def _sigmoid_loss(chosen_logratios, rejected_logratios, *, beta, label_smoothing, **_):
    z = beta * (chosen_logratios - rejected_logratios)
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


@register_dpo_loss("hinge", summary="hinge: max(0, 1 - beta h)")
def _hinge_loss(chosen_logratios, rejected_logratios, *, beta, **_):
    return torch.relu(1 - beta * (chosen_logratios - rejected_logratios))


@register_dpo_loss("ipo", needs_lengths=True,
                   summary="IPO: (h_avg - 1/(2 beta))^2 on per-token averaged log-ratios")
def _ipo_loss(chosen_logratios, rejected_logratios, *, beta, chosen_lengths, rejected_lengths, **_):
    chosen_avg = chosen_logratios / chosen_lengths.to(chosen_logratios).clamp(min=1)
    rejected_avg = rejected_logratios / rejected_lengths.to(rejected_logratios).clamp(min=1)
    return (chosen_avg - rejected_avg - 1 / (2 * beta)) ** 2


@register_dpo_loss("robust", uses_label_smoothing=True,
                   summary="robust DPO: unbiased under labels flipped with probability label_smoothing")
def _robust_loss(chosen_logratios, rejected_logratios, *, beta, label_smoothing, **_):
    z = beta * (chosen_logratios - rejected_logratios)
    eps = label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


DPO_LOSS_TYPES: tuple[str, ...] = registered_dpo_losses()
"""The built-in loss types (``sigmoid``, ``hinge``, ``ipo``, ``robust``)."""

_SIMPO = DPOLossSpec("simpo", simpo_loss, uses_label_smoothing=True,
                     summary="SimPO: -log sigmoid(beta (avg_c - avg_r) - simpo_gamma), no reference")
"""SimPO's entry for the option checks; not in the registry, whose losses all take reference log-ratios."""
