"""Per-row scoring that runs in the reward manager's process or its workers.

Kept free of torch imports so spawned worker processes start quickly.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable


def score_row(fn: Callable, row: int, data_source: Any, solution: str, ground_truth: Any, extra_info: Any) -> tuple:
    """``("ok", result)`` or ``("error", message, traceback)``; never raises, so a worker's failure
    can still be reported with its row."""
    try:
        value = fn(data_source=data_source, solution_str=solution, ground_truth=ground_truth, extra_info=extra_info)
        return ("ok", value)
    except Exception as e:  # any scorer failure is reported with its row
        return ("error", f"{type(e).__name__}: {e}", traceback.format_exc())


def score_chunk(fn: Callable, jobs: list[tuple]) -> list[tuple]:
    return [score_row(fn, *job) for job in jobs]
