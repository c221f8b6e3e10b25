"""posttrain's error classes and how the command line reports them.

Every error a user can cause derives from `PosttrainError`; the message names the key, file, row or
value and what would be valid. The command line (`run_cli`) prints such an error as one line,
``error: <message>``, and exits with the class's ``exit_code``; anything else is a bug and keeps
its Python traceback. ``--debug`` (any sub-command) or ``POSTTRAIN_DEBUG=1`` also prints the
traceback of a user error.

Exit codes: 0 done; 1 a user error found while running (data; reward, a reward function calling
``sys.exit`` included; checkpoint; a failed write such as a full disk, `posttrain.host.disk`; dynamic
sampling that cannot fill its batch, `posttrain.trainer.dynamic_sampling`);
2 a config or command-line error found before the run starts; 3 the run stopped on non-finite
losses; 130 / 143 stopped by SIGINT / SIGTERM (after saving a checkpoint when ``trainer.save_freq``
allows it, see `posttrain.trainer.trainer`).

This module imports nothing from posttrain, so every layer (storage included) may use it.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

__all__ = ["CheckpointError", "ConfigError", "DataError", "PosttrainError", "SignalStop", "debug_enabled", "format_error",
           "read_utf8", "run_cli", "user_errors"]

DEBUG_ENV = "POSTTRAIN_DEBUG"
_DEBUG = False  # set while a `run_cli` call with --debug runs


class PosttrainError(Exception):
    """A problem the user can fix (bad key, file, row, value, checkpoint); never a bug in posttrain."""

    exit_code = 1


class ConfigError(PosttrainError, ValueError):
    """A config problem a user can fix; the message names the key and what would be valid."""

    exit_code = 2


class DataError(PosttrainError, ValueError):
    """A prompt file or one of its rows is unusable; the message names file, row and field. Here, not in
    `posttrain.data`, because the rollout loops check rows too and may not import the data room."""


class CheckpointError(PosttrainError, RuntimeError):
    """A checkpoint is missing, incomplete, unsafe to load, or from a different run config. Here, not in
    `posttrain.checkpoint`, because rooms below it (models' adapters, the rank launcher) refuse checkpoints too."""


class SignalStop(PosttrainError):
    """The run was stopped by SIGINT/SIGTERM (after saving, when it could); exits 128 + the signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + int(signum)


def read_utf8(path: str | os.PathLike, error: type[PosttrainError] = PosttrainError) -> str:
    """A text file's contents; ``error`` naming the file, line and column of the first byte that is
    not UTF-8 (a missing or unreadable file: ``error`` with the OS's reason)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise error(f"{path}: cannot read it ({err.strerror or err})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise error(f"{path}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x} at column {column}); "
                    "save the file as UTF-8") from None


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception classes reported as one ``error:`` line: `PosttrainError`, plus the Ray worker
    group's error once that module is loaded (it cannot derive from ours without importing ray here)."""
    classes: list[type[BaseException]] = [PosttrainError]
    ray_pool = sys.modules.get("posttrain.distributed.ray_pool")
    if ray_pool is not None and hasattr(ray_pool, "WorkerGroupError"):
        classes.append(ray_pool.WorkerGroupError)
    return tuple(classes)


def debug_enabled(argv: list[str] | None = None) -> bool:
    return (argv is not None and "--debug" in argv) or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def format_error(err: BaseException) -> str:
    """``error: <message>``; a multi-line message keeps its lines."""
    text = str(err).strip() or type(err).__name__
    return f"error: {text}"


def run_cli(fn: Callable[[list[str]], int | None], argv: list[str]) -> int:
    """Call a sub-command's ``fn(argv)``; a user error becomes one ``error:`` line and its exit code.

    ``--debug`` is taken out of ``argv`` (any position) and turns on tracebacks for user errors.
    """
    global _DEBUG
    debug = debug_enabled(argv) or _DEBUG
    outer, _DEBUG = _DEBUG, debug  # nested entry points (main_ppo.run) see the flag too
    argv = [a for a in argv if a != "--debug"]
    try:
        return int(fn(argv) or 0)
    except user_errors() as err:
        if debug:
            traceback.print_exc()
        sys.stdout.flush()
        print(format_error(err), file=sys.stderr, flush=True)
        return int(getattr(err, "exit_code", 1))
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("\ninterrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        _DEBUG = outer
