"""Per-row scoring that runs in the reward manager's process or its workers.

Kept free of torch imports so spawned worker processes start quickly.

A row's time-out (``reward.timeout_s``) is a SIGALRM timer around the scorer, in whichever process
runs it (the trainer's main thread, or a pool worker's): Python-level hangs end with a
``("error", "timed out ...")`` result. A scorer stuck inside C code does not see the alarm; in a
pool worker the manager's own deadline catches that case and kills the worker.
"""

from __future__ import annotations

import math
import signal
import threading
import traceback
from typing import Any, Callable


class RowTimeout(Exception):
    """A scorer ran past ``reward.timeout_s`` on one row."""


def _alarm(signum, frame):
    raise RowTimeout()


def score_row(fn: Callable, row: int, data_source: Any, solution: str, ground_truth: Any, extra_info: Any,
              timeout: float | None = None) -> tuple:
    """``("ok", result)`` or ``("error", message, traceback)``; never raises, so a worker's failure
    can still be reported with its row."""
    timed = bool(timeout) and threading.current_thread() is threading.main_thread()
    previous = None
    if timed:
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, float(timeout))
    try:
        value = fn(data_source=data_source, solution_str=solution, ground_truth=ground_truth, extra_info=extra_info)
        return ("ok", value)
    except RowTimeout:
        return ("error", f"timed out after {timeout:g} s (reward.timeout_s)", "")
    except SystemExit as e:  # sys.exit(3) would end the run with the non-finite-loss exit code, unexplained
        return ("error", exit_message(e), traceback.format_exc())
    except Exception as e:  # any scorer failure is reported with its row
        return ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)


def exit_message(err: SystemExit) -> str:
    """What a scorer that called ``sys.exit`` is reported as (KeyboardInterrupt is not caught: Ctrl-C stops)."""
    return (f"it called sys.exit({err.code!r}); a reward function must return a score (or raise an exception), "
            "never end the process")


def score_chunk(fn: Callable, jobs: list[tuple], timeout: float | None = None) -> list[tuple]:
    return [score_row(fn, *job, timeout=timeout) for job in jobs]


def die_with_parent() -> None:
    """Pool initializer: the kernel kills this worker when the process that started it dies (Linux),
    so a scorer stuck in a worker never outlives the trainer, even one killed with SIGKILL."""
    try:
        import ctypes
        import os

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)
    except (OSError, AttributeError):  # not Linux: the manager's close() still ends the workers
        pass


def is_finite_number(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):
        return True  # not a number at all: the type check reports it
