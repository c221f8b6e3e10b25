"""KL penalty estimators and KL coefficient controllers (verl 0.9 semantics).

Estimators of KL(pi || pi_ref) from per-token log-probs, J. Schulman, "Approximating KL
divergence", http://joschu.net/blog/kl-approx.html, with r = pi_ref / pi:

    kl / k1         log pi - log pi_ref                        (unbiased, high variance)
    abs             |log pi - log pi_ref|
    mse / k2        0.5 * (log pi - log pi_ref)^2
    low_var_kl / k3 r - log r - 1, log r clamped to [-20, 20], result clamped to [-10, 10]
    full            sum_v pi_v (log pi_v - log pi_ref_v) from full log-prob distributions
                    `[batch, response_len, vocab]` (verl 0.9 raises NotImplementedError here)

A trailing "+" (e.g. "k3+") keeps the forward value of the estimator but takes the gradient of k2,
whose expected gradient is the true KL gradient (straight-through), as verl 0.9 does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from posttrain.algorithms.utils import config_value

_BASE_KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# every name `kl_penalty` accepts; "full" has no straight-through variant
KL_PENALTY_TYPES: tuple[str, ...] = _BASE_KL_TYPES + ("full",) + tuple(f"{name}+" for name in _BASE_KL_TYPES)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate, `[batch, response_len]`.

    logprob, ref_logprob: `[batch, response_len]` log-probs of the sampled tokens under the policy
    and the reference (for "full": `[batch, response_len, vocab]` normalised log-probs).
    """
    if kl_penalty not in KL_PENALTY_TYPES:
        raise ValueError(f"unknown kl penalty {kl_penalty!r}; valid: {KL_PENALTY_TYPES}")
    straight_through = kl_penalty.endswith("+")
    forward = _kl_forward(logprob, ref_logprob, kl_penalty.rstrip("+"))
    if not straight_through or kl_penalty in ("mse+", "k2+"):
        return forward
    # value of `forward`, gradient of k2 (unbiased gradient of KL)
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + forward.detach()


def _kl_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    if name in ("kl", "k1"):
        return logprob - ref_logprob
    if name == "abs":
        return (logprob - ref_logprob).abs()
    if name in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if name in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref_logprob - logprob, min=-20, max=20)  # log(pi_ref / pi)
        k3 = (torch.exp(log_ratio) - log_ratio - 1).contiguous()
        return torch.clamp(k3, min=-10, max=10)
    if name == "full":
        if logprob.dim() < 3 or logprob.shape != ref_logprob.shape:
            raise ValueError(
                "kl penalty 'full' needs full log-prob distributions [batch, response_len, vocab]; "
                f"got shapes {tuple(logprob.shape)} and {tuple(ref_logprob.shape)}"
            )
        return (logprob.exp() * (logprob - ref_logprob)).sum(dim=-1)
    raise ValueError(f"unknown kl penalty {name!r}")


class FixedKLController:
    """Constant KL coefficient; `update` is a no-op."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept for the controller interface)."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient, Ziegler et al. 2019, https://arxiv.org/abs/1909.08593:

    e = clip(current_kl / target_kl - 1, -0.2, 0.2);  beta <- beta * (1 + e * n_steps / horizon).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient towards keeping `current_kl` at the target."""
        error = float(np.clip(float(current_kl) / self.target - 1, -0.2, 0.2))
        self.value *= 1 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


def get_kl_controller(kl_ctrl: Any) -> FixedKLController | AdaptiveKLController:
    """Build a controller from `algorithm.kl_ctrl` (fields `type`, `kl_coef`, `target_kl`, `horizon`)."""
    kind = config_value(kl_ctrl, "type")
    if kind == "fixed":
        return FixedKLController(kl_coef=config_value(kl_ctrl, "kl_coef"))
    if kind == "adaptive":
        horizon = config_value(kl_ctrl, "horizon")
        if not horizon > 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}")
        return AdaptiveKLController(
            init_kl_coef=config_value(kl_ctrl, "kl_coef"),
            target_kl=config_value(kl_ctrl, "target_kl"),
            horizon=horizon,
        )
    raise ValueError(f"algorithm.kl_ctrl.type must be 'fixed' or 'adaptive', got {kind!r}")
