"""Rule-based scorers, dispatch by data_source, custom reward functions and the reward manager.

- :func:`default_compute_score` (``posttrain.rewards.dispatch``): gsm8k / MATH / arithmetic by ``data_source``.
- :func:`load_custom_reward_fn` (``posttrain.rewards.custom``): ``custom_reward_function.path`` / ``.name``.
- :class:`RewardManager`, :class:`BatchRewardFn` (``posttrain.rewards.manager``): fill ``token_level_scores``.
- ``posttrain.rewards.loop``: verl 0.9's reward loop (managers naive, dapo, limit, remote; ``@register``;
  ``build_reward_manager``), with sync or async functions (``posttrain.rewards.functions``).
- ``posttrain.rewards.judge``: a judge client for any OpenAI-compatible endpoint, with limits.

The manager (and torch) is imported on first use, so scorer worker processes start quickly.
"""

from posttrain.rewards.custom import CustomRewardFn, load_custom_reward_fn
from posttrain.rewards.dispatch import KNOWN_DATA_SOURCES, UnknownDataSourceError, default_compute_score

__all__ = [
    "default_compute_score",
    "KNOWN_DATA_SOURCES",
    "UnknownDataSourceError",
    "load_custom_reward_fn",
    "CustomRewardFn",
    "RewardManager",
    "BatchRewardFn",
    "RewardError",
    "place_on_last_token",
]

_LAZY = {"RewardManager", "BatchRewardFn", "RewardError", "place_on_last_token"}


def __getattr__(name):
    if name in _LAZY:
        from posttrain.rewards import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'posttrain.rewards' has no attribute {name!r}")
