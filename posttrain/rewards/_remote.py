"""What a ``remote`` reward manager's worker process runs (no torch import: workers start quickly).

The scoring function and the keywords every call shares (a GenRM function's address and tokenizer) reach
each worker once, through the pool's initializer; a call then carries only its row. A call runs under
the row's time-out (``SIGALRM`` in the worker's main thread, so a Python-level hang ends there), and
returns the judge counters it moved, so ``reward/judge_*`` metrics count calls made in workers too.
"""

from __future__ import annotations

import signal
import traceback
from typing import Any, Callable

from posttrain.rewards._worker import RowTimeout, die_with_parent, exit_message

_FN: Callable | None = None
_SHARED: dict[str, Any] = {}


def init_worker(fn: Callable, shared: dict[str, Any]) -> None:
    global _FN, _SHARED
    die_with_parent()
    _FN, _SHARED = fn, dict(shared)


def ready() -> bool:
    """A no-op the manager runs on each new worker: it returns once the worker is up."""
    return _FN is not None


def _alarm(signum, frame):
    raise RowTimeout()


def call(row: dict[str, Any], timeout_s: float | None) -> tuple:
    """``("ok", value, judge_counts)`` or ``("error", message, traceback, judge_counts)``; never raises."""
    if timeout_s:
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, float(timeout_s))
    try:
        out: tuple = ("ok", _FN(**row, **_SHARED))
    except RowTimeout:
        out = ("error", f"timed out after {timeout_s:g} s (reward.timeout_s)", "")
    except SystemExit as err:
        out = ("error", exit_message(err), traceback.format_exc())
    except Exception as err:
        out = ("error", f"{type(err).__name__}: {err}", traceback.format_exc())
    finally:
        if timeout_s:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return (*out, _judge_counts())


def _judge_counts() -> dict[str, float]:
    import sys

    judge = sys.modules.get("posttrain.rewards.judge")
    return judge.judge_metrics(reset=True) if judge is not None else {}
