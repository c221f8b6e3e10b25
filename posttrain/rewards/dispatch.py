"""``default_compute_score``: pick the rule-based scorer by ``data_source``, as verl does."""

from __future__ import annotations

from typing import Any

from posttrain.errors import PosttrainError

__all__ = ["default_compute_score", "KNOWN_DATA_SOURCES", "UnknownDataSourceError"]

_GSM8K = ("openai/gsm8k",)
_MATH = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
_ARITHMETIC = ("posttrain/arithmetic",)
KNOWN_DATA_SOURCES: tuple[str, ...] = _GSM8K + _MATH + _ARITHMETIC


class UnknownDataSourceError(PosttrainError, NotImplementedError):
    """No built-in scorer for a data_source (verl raises ``NotImplementedError`` too)."""


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> float | dict:
    """Score one reply with the built-in scorer for ``data_source``.

    Returns a float (ints and bools are converted), or the scorer's dict unchanged.
    Extra keyword arguments are accepted and ignored, as in verl.
    """
    if data_source in _GSM8K:
        from posttrain.rewards import gsm8k

        res = gsm8k.compute_score(solution_str, ground_truth)
    elif data_source in _MATH:
        from posttrain.rewards import math

        res = math.compute_score(solution_str, ground_truth)
    elif data_source in _ARITHMETIC:
        from posttrain.rewards import arithmetic

        res = arithmetic.score_both(solution_str, ground_truth)  # strict reward, flexible beside it
    else:
        raise UnknownDataSourceError(
            f"no built-in reward for data_source={data_source!r}; known: {list(KNOWN_DATA_SOURCES)}. "
            "Set custom_reward_function.path and .name to score other data."
        )
    if isinstance(res, dict):
        return res
    return float(res)
