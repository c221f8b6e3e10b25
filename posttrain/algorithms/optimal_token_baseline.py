"""Optimal Token Baseline (OTB) advantage estimators, verl 0.9.1's ``optimal_token_baseline`` and
``tir_optimal_token_baseline``: a baseline per token position instead of one per response.

Shapes: ``[batch, response_len]`` for every tensor argument; ``index`` is ``[batch]`` group ids (uids).

The gradient of log pi at a token has squared norm ``||s_t||^2 = 1 - 2 pi_t + sum_v pi_v^2`` (the
softmax's score function), so ``W_t = sum_{j <= t} ||s_j||^2`` measures how much a response's path has
varied up to token ``t``. Within each group of responses to one prompt the variance-minimising baseline
at token ``t`` is the ``W``-weighted mean of the returns there::

    G_t = sum_{j >= t} r_j                  (reward-to-go, undiscounted)
    B_t = sum_i G_{i,t} W_{i,t} / (sum_i W_{i,t} + eps)
    A_t = G_t - B_t

With rollout-correction weights rho (``rollout_is_weights``), each ``||s_j||^2`` is scaled by ``rho_j^2``.
``pi_t`` comes from the old log-probs and ``sum_v pi_v^2`` from the old-log-prob pass
(``actor_rollout_ref.actor.calculate_sum_pi_squared=True``; `posttrain.models.logprobs`).

``handle_zero_tail``: where one response of a group is longer than all others, its tokens past the
second-longest response have no other response to compare with (the baseline would be its own return,
its advantage 0); their baseline is set to 0 instead, so they keep their return as advantage.

The tool-integrated form (``tir_``) indexes positions by the count of valid tokens rather than by
column: in a multi-turn response, whose mask has holes where tool output sits, its k-th generated
token is compared with the k-th generated token of the others. Empty responses take no part in their
group. For responses without holes both forms agree, except that an empty response still counts as
a group member in the plain form.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from posttrain.algorithms.advantages import register_adv_est

__all__ = ["compute_multi_turn_optimal_token_baseline_advantage", "compute_optimal_token_baseline_advantage"]


def _returns_and_path_variance(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                               rollout_is_weights):
    """(reward-to-go ``G``, cumulative path variance ``W``), each ``[batch, response_len]``."""
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    per_token = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared  # ||s_t||^2
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights**2
    return returns, (per_token * response_mask).cumsum(dim=-1)


def _group_rows(index: Any, keep: list[bool]) -> list[list[int]]:
    """Rows of each group id, in batch order, of the rows where ``keep`` is true."""
    rows: dict[Any, list[int]] = {}
    for i, uid in enumerate(np.asarray(index, dtype=object).tolist()):
        if keep[i]:
            rows.setdefault(uid, []).append(i)
    return list(rows.values())


def _token_baselines(returns, path_variance, mask, groups, handle_zero_tail: bool, epsilon: float):
    """Baseline ``[batch, L]`` per group and position (0 for a group of one); see the module docstring."""
    baselines = torch.zeros_like(returns)
    lengths = mask.sum(dim=-1)  # [batch]
    for rows in groups:
        if len(rows) < 2:
            continue  # no other response: advantage = return
        at = torch.tensor(rows, device=returns.device)
        w = path_variance[at] * mask[at]  # [n, L]
        baselines[at] = ((returns[at] * w).sum(dim=0) / (w.sum(dim=0) + epsilon)).to(baselines.dtype)
        if handle_zero_tail:
            group_lengths = lengths[at]
            longest, second = torch.sort(group_lengths).values[-2:].tolist()[::-1]
            is_longest = (group_lengths == longest).nonzero(as_tuple=True)[0]
            if is_longest.numel() == 1 and longest > second:
                baselines[rows[int(is_longest[0])], int(second):] = 0.0
    return baselines


@register_adv_est("optimal_token_baseline", needs_groups=True, needs_sum_pi_squared=True,
                  summary="return-to-go minus a per-token group baseline weighted by each path's variance "
                          "(needs actor.calculate_sum_pi_squared; no critic)")
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB with positions by column: ``(A_t = G_t - B_t over the mask, G_t)`` (module docstring)."""
    with torch.no_grad():
        returns, path_variance = _returns_and_path_variance(token_level_rewards, response_mask, old_log_probs,
                                                            sum_pi_squared, rollout_is_weights)
        groups = _group_rows(index, [True] * len(returns))
        baselines = _token_baselines(returns, path_variance, response_mask, groups, handle_zero_tail, epsilon)
        advantages = (returns - baselines) * response_mask
    return advantages, returns


@register_adv_est("tir_optimal_token_baseline", needs_groups=True, needs_sum_pi_squared=True,
                  summary="optimal_token_baseline over each response's generated tokens only, for multi-turn "
                          "responses with tool output inside (no critic)")
def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB with positions by valid-token count (module docstring): each row's valid tokens are packed to
    the left (``[batch, longest]``), baselines are taken there, and the advantages are put back in place."""
    with torch.no_grad():
        returns, path_variance = _returns_and_path_variance(token_level_rewards, response_mask, old_log_probs,
                                                            sum_pi_squared, rollout_is_weights)
        valid = response_mask.bool()
        lengths = valid.sum(dim=-1)  # [batch]
        width = int(lengths.max()) if lengths.numel() else 0
        packed = torch.arange(width, device=valid.device)[None] < lengths[:, None]  # [batch, width]
        packed_returns = returns.new_zeros(len(returns), width).masked_scatter_(packed, returns[valid])
        packed_w = path_variance.new_zeros(len(returns), width).masked_scatter_(packed, path_variance[valid])
        groups = _group_rows(index, (lengths > 0).tolist())
        mask = packed.to(returns.dtype)
        baselines = _token_baselines(packed_returns, packed_w, mask, groups, handle_zero_tail, epsilon)
        advantages = torch.zeros_like(returns).masked_scatter_(valid, (packed_returns - baselines)[packed])
        advantages = advantages * response_mask
    return advantages, returns
