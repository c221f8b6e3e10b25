"""How a learned reward model's score meets the rule-based reward, in training and in validation.

verl's rules, followed here:

- Training (``ray_trainer.py`` ``_compute_or_extract_reward``; the reward managers'
  ``_extract_reward_from_rm_scores``): once the reward model has put ``rm_scores`` in the batch,
  they *are* the reward; the reward function (rule-based or custom) is not called.
  ``reward_model.combine=sum`` (posttrain) adds the two instead, for a run that wants both a
  checkable answer and a learned preference.
- Validation (``_validate``): verl scores held-out responses with ``val_reward_fn``, the rule-based
  reward manager, and runs no reward model there; when the reward model is on and the validation
  rows say ``reward_model.style == "model"`` (no checkable answer), it skips validation.

The reward model's own mean score is logged as ``reward_model/score/mean`` either way.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from posttrain.batch import Batch

__all__ = ["COMBINE_MODES", "RM_SCORE_KEY", "combine_rm_scores", "score_responses", "validation_skip_reason"]

COMBINE_MODES = ("replace", "sum")
RM_SCORE_KEY = "reward_model/score"
"""Per-row reward-model scores in the reward's extra output (metric ``reward_model/score/mean``)."""


def score_responses(batch: Batch, reward_fn: Callable[[Batch], tuple], workers: Any,
                    combine: str = "replace") -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """``(token_level_scores [N, R], extra)``: the reward function's alone without a reward model;
    with one, its scores (``replace``) or their sum with the reward function's (``sum``)."""
    if not getattr(workers, "has_rm", False):
        return reward_fn(batch)
    check_combine(combine)
    return combine_rm_scores(batch, workers.compute_rm_score(batch), reward_fn, combine)


def check_combine(combine: str) -> None:
    if combine not in COMBINE_MODES:
        raise ValueError(f"reward_model.combine={combine!r}; valid: {', '.join(COMBINE_MODES)}")


def combine_rm_scores(batch: Batch, rm_scores: torch.Tensor, reward_fn: Callable[[Batch], tuple],
                      combine: str = "replace") -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """``(token_level_scores [N, R], extra)`` from the reward model's ``rm_scores`` ``[N, R]``: they
    alone (``replace``, verl's rule: the reward function is not called) or their sum with the reward
    function's (``sum``); ``extra`` carries each row's reward-model score (`RM_SCORE_KEY`)."""
    check_combine(combine)
    rm_scores = rm_scores.to(torch.float32)
    extra = {RM_SCORE_KEY: rm_scores.sum(-1).to(torch.float64).cpu().numpy()}
    if combine == "replace":
        return rm_scores, extra
    rule_scores, rule_extra = reward_fn(batch)
    return rule_scores + rm_scores.to(rule_scores.device), {**rule_extra, **extra}


def validation_skip_reason(reward_model_enabled: bool, val_batches: Sequence[Batch]) -> str | None:
    """Why validation is skipped (verl: reward model on and the rows' ``reward_model.style`` is
    ``model``, so there is no rule to score them with), or None. verl looks at the first row."""
    if not reward_model_enabled or not val_batches or "reward_model" not in val_batches[0].non_tensor_batch:
        return None
    first = val_batches[0].non_tensor_batch["reward_model"][0]
    if isinstance(first, dict) and first.get("style") == "model":
        return ("validation skipped: reward_model.enable=True and the validation rows have reward_model.style=model "
                "(verl validates only rows a rule can score; it runs no reward model there)")
    return None
