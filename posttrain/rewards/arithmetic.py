"""Scorer for the built-in arithmetic task (``data_source="posttrain/arithmetic"``).

``strict`` (default): the integer after the last ``####`` (spaces and thousands commas allowed),
compared exactly with the ground truth. ``flexible``: the last integer anywhere in the reply.
A reply with an extractable but wrong answer gets ``format_score`` (0 by default: no credit for
format alone); one with no answer gets 0.

`score_both` is what training and validation use for ``data_source="posttrain/arithmetic"``: the
strict score as the reward, and both accuracies beside it, so a run shows whether it learned the
answers (``flexible_acc``) or only the ``#### N`` format (``acc`` rising while ``flexible_acc`` stays).
"""

from __future__ import annotations

import re

__all__ = ["extract_answer", "compute_score", "score_both"]

_STRICT = re.compile(r"####\s*(-?\d[\d,]*)")
_ANY_INT = re.compile(r"-?\d[\d,]*")


def extract_answer(solution_str: str, method: str = "strict") -> int | None:
    """The answer as an int, or ``None`` when the reply has none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    found = (_STRICT if method == "strict" else _ANY_INT).findall(solution_str)
    if not found:
        return None
    digits = found[-1].replace(",", "")
    return int(digits)


def compute_score(
    solution_str: str, ground_truth: str | int, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == int(str(ground_truth).replace(",", "").strip()) else float(format_score)


def score_both(solution_str: str, ground_truth: str | int) -> dict[str, float | str]:
    """``{"score": strict, "acc": strict, "flexible_acc": flexible, "pred": the strict answer}`` (1.0 right,
    0.0 wrong; ``pred`` as text, ``"[INVALID]"`` when there is none, as verl's math_dapo scorer gives it:
    the vote of validation's maj@N)."""
    strict = compute_score(solution_str, ground_truth, method="strict")
    answer = extract_answer(solution_str, "strict")
    return {"score": strict, "acc": strict, "flexible_acc": compute_score(solution_str, ground_truth, method="flexible"),
            "pred": "[INVALID]" if answer is None else str(answer)}
