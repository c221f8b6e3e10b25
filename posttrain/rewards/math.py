"""MATH-style scorer: the last ``\\boxed{}`` in the reply, checked against the ground truth with
the ``math-verify`` library (``pip install math-verify``).

verl's default for MATH sources is a string-normalising ``is_equiv``; math-verify also accepts
equivalent forms (``\\frac{1}{2}`` vs ``0.5``, ``2\\sqrt{2}`` vs ``\\sqrt{8}``). A reply without a
boxed answer scores 0. Each item is bounded by ``timeout_s`` (math-verify's own SIGALRM timeouts,
effective on a process's main thread, which includes the reward manager's worker processes); a
timeout scores 0.
"""

from __future__ import annotations

import math
import threading

from posttrain.rewards.latex import last_boxed_answer

__all__ = ["compute_score", "is_equivalent"]


def _math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(
            "the MATH scorer needs the math-verify package: pip install math-verify (or posttrain[math])"
        ) from e
    return math_verify


def is_equivalent(answer: str, ground_truth: str, timeout_s: float | None = 5.0) -> bool:
    """Whether two LaTeX answers are mathematically equal according to math-verify."""
    if answer.strip() == ground_truth.strip():
        return True
    mv = _math_verify()
    on_main = threading.current_thread() is threading.main_thread()
    secs = max(1, math.ceil(timeout_s)) if (timeout_s and on_main) else None
    cfg = [mv.LatexExtractionConfig()]
    gold = mv.parse("\\boxed{" + ground_truth + "}", cfg, parsing_timeout=secs)
    pred = mv.parse("\\boxed{" + answer + "}", cfg, parsing_timeout=secs)
    if not gold or not pred:
        return False
    return bool(mv.verify(gold, pred, timeout_seconds=secs))


def compute_score(solution_str: str, ground_truth: str, timeout_s: float | None = 5.0) -> float:
    """1.0 when the last boxed answer of ``solution_str`` equals ``ground_truth``, else 0.0."""
    _math_verify()  # fail the same way whether or not this reply needs it
    answer = last_boxed_answer(solution_str)
    if answer is None:
        return 0.0
    return 1.0 if is_equivalent(answer, str(ground_truth), timeout_s) else 0.0
