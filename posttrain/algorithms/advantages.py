"""Advantage estimators, registered by name (`algorithm.adv_estimator`), with verl 0.9 semantics.

Calling convention (the same for every estimator, so the trainer never branches on the name)::

    fn = get_adv_estimator_fn(cfg.algorithm.adv_estimator)
    advantages, returns = fn(
        token_level_rewards=...,      # [batch, response_len] float
        response_mask=...,            # [batch, response_len] 0/1 (bool, int or float)
        index=uid,                    # [batch] numpy object array of group ids (uids)
        values=...,                   # [batch, response_len] critic values, or None
        reward_baselines=...,         # [batch] greedy-rollout rewards (ReMax), or None
        gamma=..., lam=...,           # floats (algorithm.gamma / algorithm.lam)
        norm_adv_by_std_in_grpo=...,  # bool (algorithm.norm_adv_by_std_in_grpo)
        config=cfg.algorithm,         # the algorithm section (attributes or mapping)
        non_tensor_batch=...,         # {column: [batch] array}: per-row columns, the reward's dict parts included
        old_log_probs=...,            # [batch, response_len], where the step recomputed them
        sum_pi_squared=...,           # [batch, response_len] sum_v pi_v^2 (actor.calculate_sum_pi_squared)
        rollout_is_weights=...,       # [batch, response_len] rollout-correction weights, or None
    )

Every estimator takes keyword arguments with verl's names, ignores the ones it does not use
(`**kwargs`), and returns `(advantages, returns)`, both `[batch, response_len]`.

Where verl reads a setting from `config` rather than from its own argument, so do we (when
`config` is given): REINFORCE++ takes `config.gamma`, Pass@k takes
`config.norm_adv_by_std_in_grpo`. Without a config they fall back to the explicit argument.

As in verl, the outcome estimators score a response by `token_level_rewards.sum(-1)` over the
whole row (not only masked tokens): the reward manager puts the score on the last valid token and
zeros elsewhere. Per-group statistics are taken with the same reductions verl uses (`torch.mean`,
unbiased `torch.std`) so results agree to the last bit in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from posttrain.algorithms.utils import config_value, masked_whiten

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class EstimatorSpec:
    """What an estimator needs from the run, declared once with its registration: the config checks
    (`config/validate.py`), the critic rule (`config/derived.py:uses_critic`), the trainer and
    `posttrain diff` read it, so a newly registered estimator works everywhere."""

    name: str
    fn: AdvantageFn
    needs_critic: bool = False
    """Uses the critic's values (a critic is built and trained when ``critic.enable`` is null)."""
    needs_groups: bool = False
    """Compares the responses to the same prompt: ``rollout.n >= 2``."""
    needs_greedy_baseline: bool = False
    """Needs ``reward_baselines``: the reward of a greedy response to each prompt (ReMax)."""
    needs_sum_pi_squared: bool = False
    """Reads ``old_log_probs`` and ``sum_pi_squared``: the old-log-prob pass runs and also sums pi^2 over
    the vocabulary (``actor_rollout_ref.actor.calculate_sum_pi_squared=True``; not in bypass mode)."""
    needs_reward_parts: bool = False
    """Reads the reward parts named by ``algorithm.gdpo_reward_keys`` (keys of the scoring function's dict)."""
    summary: str = "a registered estimator"
    """One line on what it computes (shown by `posttrain diff`)."""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(*args, **kwargs)


ADV_ESTIMATOR_REGISTRY: dict[str, AdvantageFn] = {}
"""The one registry, as verl has it: name -> the registered function. A function placed straight into
it (as verl's tests and users do) is an estimator like a decorated one, declaring no needs."""

_DECLARED: dict[str, EstimatorSpec] = {}
"""What `register_adv_est` was told about each name's function. It describes the registry's entry only
while that entry is still the same function: an entry replaced straight in the dict declares nothing."""


def register_adv_est(name: str, *, needs_critic: bool = False, needs_groups: bool = False,
                     needs_greedy_baseline: bool = False, needs_sum_pi_squared: bool = False,
                     needs_reward_parts: bool = False, summary: str = "a registered estimator",
                     ) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering an advantage estimator under `name` (str or an Enum with `.value`),
    with what it needs from the run (see `EstimatorSpec`); verl's one-argument form works too.

    Registering the same function again is accepted; a different function under a taken name raises
    ValueError (verl's rule).
    """
    key = getattr(name, "value", name)

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        existing = ADV_ESTIMATOR_REGISTRY.get(key)
        if existing is not None and existing is not fn:
            raise ValueError(f"advantage estimator {key!r} is already registered to "
                             f"{getattr(existing, '__qualname__', existing)!r}, not {fn.__qualname__}")
        ADV_ESTIMATOR_REGISTRY[key] = fn
        _DECLARED[key] = EstimatorSpec(key, fn, needs_critic=needs_critic, needs_groups=needs_groups,
                                       needs_greedy_baseline=needs_greedy_baseline,
                                       needs_sum_pi_squared=needs_sum_pi_squared,
                                       needs_reward_parts=needs_reward_parts, summary=summary)
        return fn

    return decorator


def get_adv_estimator_fn(name: str) -> AdvantageFn:
    """The function registered under `name` (the registry's entry itself); ValueError listing the
    valid names otherwise."""
    key = getattr(name, "value", name)
    if key not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"unknown advantage estimator {key!r}; registered: {registered_adv_estimators()}")
    return ADV_ESTIMATOR_REGISTRY[key]


def adv_estimator_spec(name: str) -> EstimatorSpec:
    """The registration of `name`: its function and what it declared it needs (nothing, for a function
    placed straight into the registry); ValueError listing the valid names otherwise."""
    key = getattr(name, "value", name)
    fn = get_adv_estimator_fn(key)
    declared = _DECLARED.get(key)
    return declared if declared is not None and declared.fn is fn else EstimatorSpec(key, fn)


def registered_adv_estimators() -> tuple[str, ...]:
    """Names of all registered advantage estimators, sorted (for config validation messages)."""
    return tuple(sorted(ADV_ESTIMATOR_REGISTRY))


class EstimatorsWith:
    """A live view of the registered estimator names whose spec has ``need`` set: ``name in view``
    reads the registry at that moment, so estimators registered later are included."""

    def __init__(self, need: str):
        self.need = need

    def names(self) -> tuple[str, ...]:
        return tuple(n for n in registered_adv_estimators() if getattr(adv_estimator_spec(n), self.need))

    def __contains__(self, name: object) -> bool:
        key = getattr(name, "value", name)
        return key in ADV_ESTIMATOR_REGISTRY and bool(getattr(adv_estimator_spec(key), self.need))

    def __iter__(self):
        return iter(self.names())

    def __repr__(self) -> str:
        return f"EstimatorsWith({self.need!r}: {', '.join(self.names())})"


# ---------------------------------------------------------------------------------------------
# helpers


def _groups(index: Any) -> dict[Any, torch.Tensor]:
    """Row indices of each group id, in batch order: {uid: LongTensor[group_size]}."""
    rows: dict[Any, list[int]] = {}
    for i, uid in enumerate(np.asarray(index, dtype=object).tolist()):
        rows.setdefault(uid, []).append(i)
    return {uid: torch.tensor(r, dtype=torch.long) for uid, r in rows.items()}


def _group_mean_std(scores: torch.Tensor, index: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group mean, unbiased std and size, `[batch]` each; a group of one has mean 0, std 1."""
    mean = torch.zeros_like(scores)
    std = torch.ones_like(scores)
    size = torch.ones_like(scores)
    for rows in _groups(index).values():
        rows = rows.to(scores.device)
        if len(rows) > 1:
            group = scores[rows]
            mean[rows] = torch.mean(group)
            std[rows] = torch.std(group)
            size[rows] = float(len(rows))
    return mean, std, size


def _group_ids(index: Any, device: torch.device) -> tuple[torch.Tensor, int]:
    """Each row's group as a number `[batch]` (0.. in order of first appearance), and the group count."""
    ids: dict[Any, int] = {}
    rows = [ids.setdefault(uid, len(ids)) for uid in np.asarray(index, dtype=object).tolist()]
    return torch.tensor(rows, dtype=torch.long, device=device), len(ids)


def _group_sums(values: torch.Tensor, group: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Sum of `values` `[batch]` per group, `[n_groups]` (one scatter-add, no Python loop)."""
    return values.new_zeros(n_groups).index_add_(0, group, values)


def _float_mask(response_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """0/1 mask in `like`'s dtype, so `1 - mask` works for bool masks too."""
    return response_mask.to(like.dtype)


# ---------------------------------------------------------------------------------------------
# critic-based


@register_adv_est("gae", needs_critic=True,
                  summary="per-token advantages from a learned value function (GAE; needs a critic)")
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation, https://arxiv.org/abs/1506.02438.

    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1}.
    Masked positions (observation tokens) are skipped: V_{t+1} and A_{t+1} carry across them.
    returns = A + V (before whitening); advantages are whitened over the mask (not zeroed outside it).

    token_level_rewards, values, response_mask: `[batch, response_len]`.
    """
    with torch.no_grad():
        mask = _float_mask(response_mask, values)
        next_value = torch.zeros_like(values[:, 0])
        last_adv = torch.zeros_like(values[:, 0])
        reversed_advs = []
        for t in reversed(range(token_level_rewards.shape[-1])):
            m_t = mask[:, t]
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            adv_t = delta + gamma * lam * last_adv
            next_value = values[:, t] * m_t + (1 - m_t) * next_value
            last_adv = adv_t * m_t + (1 - m_t) * last_adv
            reversed_advs.append(last_adv)
        advantages = torch.stack(reversed_advs[::-1], dim=1)
        returns = advantages + values
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


# ---------------------------------------------------------------------------------------------
# group baselines (outcome reward: one scalar per response)


@register_adv_est("grpo", needs_groups=True,
                  summary="each response's reward minus its group's mean, divided by the group's std (no critic)")
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO, https://arxiv.org/abs/2402.03300: A_i = (r_i - mean_g) / (std_g + epsilon).

    std_g is the unbiased std of the group; a group of one uses mean 0 and std 1.
    `norm_adv_by_std_in_grpo=False` drops the division (Dr.GRPO, https://arxiv.org/abs/2503.20783).
    Returns the scalar broadcast over `[batch, response_len]` times the mask, twice.
    """
    with torch.no_grad():
        scores = _grpo_scalars(token_level_rewards.sum(dim=-1), index, epsilon, norm_adv_by_std_in_grpo)
        advantages = scores.unsqueeze(-1) * response_mask
    return advantages, advantages


def _grpo_scalars(scores: torch.Tensor, index: Any, epsilon: float, norm: bool) -> torch.Tensor:
    """`[batch]` -> `(s - mean_g) / (std_g + epsilon)` (or `s - mean_g`), by `_group_mean_std`."""
    mean, std, _ = _group_mean_std(scores, index)
    return (scores - mean) / (std + epsilon) if norm else scores - mean


@register_adv_est("grpo_vectorized", needs_groups=True,
                  summary="GRPO computed with scatter-adds instead of a loop over groups (no critic)")
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (`compute_grpo_outcome_advantage`) with per-group sums instead of a loop, verl's
    ``group_mean_std``: mean_g = sum / n, std_g = sqrt(sum (s - mean_g)^2 / (n - 1)); a group of one
    has mean 0 and std 1. Equal to the loop form up to rounding (the variance is a two-pass sum here).
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)  # [batch]
        group, n_groups = _group_ids(index, scores.device)
        count = _group_sums(torch.ones_like(scores), group, n_groups)  # [groups]
        mean = _group_sums(scores, group, n_groups) / count.clamp_min(1.0)
        centred = scores - mean[group]
        std = torch.sqrt(_group_sums(centred * centred, group, n_groups) / (count - 1.0).clamp_min(1.0))
        single = count <= 1.0
        mean, std = mean.masked_fill(single, 0.0), std.masked_fill(single, 1.0)
        if norm_adv_by_std_in_grpo:
            scalars = (scores - mean[group]) / (std[group] + epsilon)
        else:
            scalars = scores - mean[group]
        advantages = scalars.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("gdpo", needs_groups=True, needs_reward_parts=True,
                  summary="GDPO: each reward part (algorithm.gdpo_reward_keys) normalised within its group, "
                          "weighted sum, whitened over the batch (no critic)")
def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    non_tensor_batch: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO, https://arxiv.org/abs/2601.05242: reward parts are normalised separately, so a part with a
    large spread cannot drown the others. For each part k (``config.gdpo_reward_keys``, read per row from
    ``non_tensor_batch[k]`` `[batch]`): A_k = GRPO(r_k) within each group; A = sum_k w_k A_k
    (``config.gdpo_reward_weights``, default 1 each); advantages = whiten(A over the mask) * mask.

    Without a config or ``non_tensor_batch`` the one part is the row's summed reward (GRPO, then
    whitened), as verl does. A part is read as float32, as verl reads it; a missing key or a value that is
    not a finite number (a row the scoring function left without that key) raises ValueError naming it.
    """
    keys = config_value(config, "gdpo_reward_keys", None) if config is not None else None
    with torch.no_grad():
        if config is not None and non_tensor_batch is not None:
            if not keys:
                raise ValueError("gdpo needs algorithm.gdpo_reward_keys: the keys of the dict the scoring function "
                                 "returns, one per reward part (e.g. [format_reward, accuracy_reward])")
            parts = [_reward_part(non_tensor_batch, key, response_mask.device) for key in keys]
            weights = config_value(config, "gdpo_reward_weights", None)
        else:
            parts, weights = [token_level_rewards.sum(dim=-1)], None
        if weights is not None and len(weights) != len(parts):
            raise ValueError(f"algorithm.gdpo_reward_weights has {len(weights)} weights for {len(parts)} "
                             f"gdpo_reward_keys ({keys}); give one weight per key")
        weights = torch.tensor([1.0] * len(parts) if weights is None else list(weights), dtype=torch.float32,
                               device=response_mask.device)
        combined = sum(weights[k] * _grpo_scalars(part, index, epsilon, norm_adv_by_std_in_grpo)
                       for k, part in enumerate(parts))  # [batch]
        advantages = masked_whiten(combined.unsqueeze(-1) * response_mask, response_mask) * response_mask
    return advantages, advantages


def _reward_part(columns: Any, key: str, device: torch.device) -> torch.Tensor:
    """The reward part ``columns[key]`` as float32 `[batch]`; ValueError when absent or not finite."""
    if key not in columns:
        raise ValueError(f"gdpo reward key {key!r} (algorithm.gdpo_reward_keys) is not among the batch's columns "
                         f"{sorted(columns)}: the scoring function must return a dict with {key!r} for every row")
    try:
        values = np.asarray(columns[key], dtype=np.float32)
    except (TypeError, ValueError) as err:
        raise ValueError(f"gdpo reward key {key!r}: the scoring function's values are not numbers ({err})") from None
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise ValueError(f"gdpo reward key {key!r} is missing or not finite in {bad.size} row(s) (first: row "
                         f"{int(bad[0])}): the scoring function must return {key!r} as a number for every row")
    return torch.from_numpy(values).to(device)


@register_adv_est("grpo_passk", needs_groups=True,
                  summary="pass@k group advantages: only the best response of a group is credited (no critic)")
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO, https://arxiv.org/abs/2503.19595: only each group's best response gets
    r_max - r_second_max (divided by std_g + epsilon when normalising); all others get 0.

    The normalisation flag comes from `config.norm_adv_by_std_in_grpo` when a config is given
    (as in verl). Every group needs at least two responses (ValueError otherwise).
    """
    if config is not None:
        norm_adv_by_std_in_grpo = config_value(config, "norm_adv_by_std_in_grpo", True)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)  # [batch]
        best_gap = torch.zeros_like(scores)
        for uid, rows in _groups(index).items():
            group = scores[rows.to(scores.device)]
            if group.numel() < 2:
                raise ValueError(f"grpo_passk needs at least 2 responses per group; group {uid!r} has {group.numel()}")
            top, top_pos = torch.topk(group, 2)
            gap = top[0] - top[1]
            if norm_adv_by_std_in_grpo:
                gap = gap / (torch.std(group) + epsilon)
            best_gap[int(rows[int(top_pos[0])])] = gap
        advantages = best_gap.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("rloo", needs_groups=True,
                  summary="each response's reward minus the mean of the other responses to its prompt (no critic)")
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO, https://arxiv.org/abs/2402.14740: A_i = r_i - mean_{j != i} r_j
    = (n * r_i - n * mean_g) / (n - 1) for a group of n > 1; a group of one keeps A_i = r_i.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)  # [batch]
        mean, _, n = _group_mean_std(scores, index)
        loo = scores * n / (n - 1) - mean * n / (n - 1)
        scores = torch.where(n > 1, loo, scores)
        advantages = scores.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("rloo_vectorized", needs_groups=True,
                  summary="RLOO computed with scatter-adds; a group of one gets advantage 0 (no critic)")
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO, https://arxiv.org/abs/2402.14740, with per-group sums instead of a loop:
    A_i = (n r_i - sum_g) / (n - 1) = r_i - mean_{j != i} r_j. Unlike the loop form (``rloo``), a group
    of one gets A = 0 (verl's ``rloo_vectorized`` does the same).
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)  # [batch]
        group, n_groups = _group_ids(index, scores.device)
        n = _group_sums(torch.ones_like(scores), group, n_groups)[group]  # [batch]: each row's group size
        total = _group_sums(scores, group, n_groups)[group]
        scalars = (n * scores - total) / (n - 1).clamp_min(1) * (n > 1)
        advantages = scalars.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("opo", needs_groups=True, summary="reward minus a length-weighted group mean (no critic)")
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO, https://arxiv.org/abs/2505.23585: baseline is the length-weighted group mean
    b_g = sum_i |y_i| r_i / sum_i |y_i| (0 for a group of one); A_i = r_i - b_g.
    """
    with torch.no_grad():
        lengths = response_mask.sum(dim=-1)  # [batch]
        scores = token_level_rewards.sum(dim=-1)  # [batch]
        baseline = torch.zeros_like(scores)
        for rows in _groups(index).values():
            rows = rows.to(scores.device)
            if len(rows) > 1:
                baseline[rows] = (lengths[rows] * scores[rows]).sum() / lengths[rows].sum()
        advantages = (scores - baseline).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("gpg", needs_groups=True,
                  summary="group-relative advantages without std normalisation, GPG-style (no critic)")
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG, https://arxiv.org/abs/2504.02546: A_i = alpha * (r_i - mean_g) / f_norm with
    alpha = batch / max(#non-zero scores, 1) (the `alpha` argument is overwritten, as in verl).
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)  # [batch]
        alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
        mean, _, _ = _group_mean_std(scores, index)
        scores = alpha * (scores - mean) / f_norm
        advantages = scores.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("reinforce_plus_plus_baseline", needs_groups=True,
                  summary="returns minus the group mean, normalised over the batch (no critic)")
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline, https://arxiv.org/abs/2501.03262: subtract the group mean (0 for a
    group of one), broadcast over tokens, then whiten over the whole batch's masked tokens.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)  # [batch]
        mean, _, _ = _group_mean_std(scores, index)
        scores = scores - mean
        tiled = scores.unsqueeze(-1).tile([1, token_level_rewards.shape[-1]]) * response_mask
        advantages = masked_whiten(tiled, response_mask) * response_mask
    return advantages, advantages


# ---------------------------------------------------------------------------------------------
# discounted returns


@register_adv_est("reinforce_plus_plus", summary="discounted returns normalised over the batch (no critic)")
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    gamma: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++, https://arxiv.org/abs/2501.03262: G_t = r_t + gamma * G_{t+1}, whitened over
    the batch's masked tokens. Masked positions get return 0 and carry G across them.

    gamma is `config.gamma` when a config is given (verl reads it there), else the `gamma` argument.
    """
    if config is not None:
        gamma = config_value(config, "gamma")
    if gamma is None:
        raise ValueError("reinforce_plus_plus needs gamma (pass config with .gamma or gamma=)")
    with torch.no_grad():
        mask = _float_mask(response_mask, token_level_rewards)
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[-1])):
            m_t = mask[:, t]
            candidate = token_level_rewards[:, t] + gamma * running
            returns[:, t] = candidate * m_t
            running = candidate * m_t + running * (1 - m_t)
        advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


@register_adv_est("remax", needs_greedy_baseline=True,
                  summary="reward minus the reward of a greedy response (no critic)")
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax, https://arxiv.org/abs/2310.10505: returns are undiscounted reward-to-go over masked
    rewards; A_t = G_t - b where b (`[batch]`) is the greedy response's reward.
    """
    with torch.no_grad():
        returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns
