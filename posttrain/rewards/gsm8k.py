"""GSM8K scorer with verl 0.9's exact semantics (``verl/utils/reward_score/gsm8k.py``).

Only the last 300 characters of the reply are searched.

- ``strict``: the last ``"#### <num>"`` (exactly one space after ``####``; ``<num>`` is an optional
  ``-`` then digits, dots and commas), with commas removed.
- ``flexible``: the last run of ``-``/digits/dots/commas that is not a lone ``"."``, kept as is:
  commas are *not* removed and a trailing period or comma stays attached ("42." != "42").

The extracted string must equal ``ground_truth`` exactly (string comparison). Score: ``score``
when equal, ``format_score`` when an answer was found but differs, 0 when none was found.
"""

from __future__ import annotations

import re

__all__ = ["extract_solution", "compute_score", "CLIP_CHARS"]

CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer string the scorer compares, or ``None``."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _NUMBER.findall(tail)
    if not found:
        return None
    for candidate in reversed(found):
        if candidate != ".":
            return candidate
    return found[0]  # every match was "."; verl's loop ends on the first one, which is "."


def compute_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score
