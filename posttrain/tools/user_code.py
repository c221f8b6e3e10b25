"""Run a tool's or an interaction's code so that nothing it does can stall or outlive the run.

A user coroutine awaited on the agent loop's event loop can block that loop (a ``time.sleep``, a
blocking socket read), and then no ``asyncio.wait_for`` time-out fires. So every call of user code
(:func:`run_user_code`) runs in its own daemon thread, on that thread's own event loop, and the
agent loop awaits a future that the thread settles: the loop stays free, the time-out always fires,
and a call that never returns is abandoned (cancelled on its loop, in case it ever yields again).
Daemon threads never keep the process alive, so a finished run exits even with such a call stuck.

What user code can rely on: each call runs on a fresh event loop in its own thread, so state shared
between calls must be thread-safe (dicts keyed by instance id, ``threading`` locks), not asyncio
primitives made on another loop. ``SystemExit`` or ``KeyboardInterrupt`` raised by user code is a
failure of that call (a ``RuntimeError``), not the end of the run.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any, Callable

__all__ = ["UserCodeTimeout", "run_user_code", "abandoned_calls"]

_abandoned_total = [0]  # calls abandoned after their time-out, in this process


class UserCodeTimeout(TimeoutError):
    """A call of user code did not finish within its time-out; it was abandoned in its thread."""


def abandoned_calls() -> int:
    """How many user-code calls this process has abandoned after their time-out."""
    return _abandoned_total[0]


async def run_user_code(call: Callable[[], Any], *, timeout: float | None, what: str) -> Any:
    """``call()`` (awaited when it returns an awaitable; bind arguments with ``functools.partial``) in a
    daemon thread with its own event loop; :class:`UserCodeTimeout` after ``timeout`` seconds (None: no
    limit). ``what`` names the call in messages ("tool calculator.execute")."""
    threaded = _ThreadedCall(call, asyncio.get_running_loop())
    threading.Thread(target=threaded.run, name=f"posttrain {what}", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(threaded.outcome), timeout)
    except asyncio.TimeoutError:
        threaded.cancel()
        _abandoned_total[0] += 1
        raise UserCodeTimeout(f"{what} did not answer within {timeout:g} s") from None
    except asyncio.CancelledError:
        threaded.cancel()
        raise


class _ThreadedCall:
    """One call: runs on its own thread and loop, settles ``outcome`` on the caller's loop."""

    def __init__(self, fn: Callable[[], Any], caller: asyncio.AbstractEventLoop):
        self.fn, self.caller = fn, caller
        self.outcome: asyncio.Future = caller.create_future()
        self.lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task | None = None
        self.cancelled = False

    def run(self) -> None:
        loop = None  # made only for an awaitable: a loop holds three file descriptors while it lives
        try:
            result = self.fn()
            if inspect.isawaitable(result):
                loop = asyncio.new_event_loop()
                result = loop.run_until_complete(self._task_on(loop, result))
        except BaseException as err:  # noqa: BLE001 - every failure of user code is reported, none escapes
            self._settle(None, err if isinstance(err, Exception) else RuntimeError(f"{type(err).__name__}: {err}"))
        else:
            self._settle(result, None)
        finally:
            with self.lock:
                self.loop = None
            if loop is not None:
                loop.close()

    def _task_on(self, loop: asyncio.AbstractEventLoop, awaitable: Any) -> asyncio.Future:
        with self.lock:
            self.loop, self.task = loop, asyncio.ensure_future(awaitable, loop=loop)
            if self.cancelled:
                self.task.cancel()
        return self.task

    def cancel(self) -> None:
        """Cancel the call's task on its own loop (it ends if it ever yields); the thread is left alone."""
        with self.lock:
            self.cancelled = True
            if self.loop is not None and self.task is not None:
                try:
                    self.loop.call_soon_threadsafe(self.task.cancel)
                except RuntimeError:  # its loop closed in the meantime
                    pass

    def _settle(self, result: Any, err: BaseException | None) -> None:
        def settle() -> None:
            if self.outcome.done() or self.cancelled:  # abandoned: nobody reads this answer
                return
            if err is not None:
                self.outcome.set_exception(err)
            else:
                self.outcome.set_result(result)

        try:
            self.caller.call_soon_threadsafe(settle)
        except RuntimeError:  # the caller's loop is closed: nobody waits for this answer any more
            pass
