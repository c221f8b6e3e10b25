"""Failed writes (a full disk, a used-up quota, a read-only file system, no permission) as one error
that names the path, what the system said and what to do, wherever posttrain writes: checkpoints,
exports, prepared data.

The system's error is not always an `OSError` by the time it arrives: ``torch.save`` to a path turns
it into ``RuntimeError: ... unexpected pos`` (no errno at all), safetensors' writer into a
``SafetensorError`` whose text ends in ``(os error 28)``, and ``torch.distributed.checkpoint`` into a
``CheckpointException`` holding each rank's failure. `os_error_of` finds the `OSError` in all of
these; `save_torch` writes through a Python file, so torch's failure keeps its `OSError` attached.

This module imports nothing from posttrain but `posttrain.errors`, so the storage layer may use it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from typing import Any, Iterator

from posttrain.errors import PosttrainError

__all__ = ["DiskWriteError", "current_umask", "folder_problem", "naming", "os_error_of", "readable_as_umask_says",
           "save_torch", "write_failure_message", "writing"]

MEANINGS = {
    errno.ENOSPC: ("the disk is full", "free space there"),
    errno.EDQUOT: ("your disk quota is used up", "free space within your quota"),
    errno.EROFS: ("the file system is mounted read-only", "write to a writable file system"),
    errno.EACCES: ("no permission to write there", "make the folder writable for this user"),
    errno.EPERM: ("the operation is not permitted there", "make the folder writable for this user"),
}
"""errno -> (what it means, the first thing to do)."""

_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


class DiskWriteError(PosttrainError):
    """A file could not be written (exit code 1); the message names the path, the errno's meaning and
    what to do. ``path`` and ``errno`` hold them for programs."""

    def __init__(self, message: str, path: str | os.PathLike | None = None, errno_code: int | None = None):
        super().__init__(message)
        self.path, self.errno = path, errno_code


def os_error_of(err: BaseException | None) -> OSError | None:
    """The `OSError` behind a failed write, or None when ``err`` is not one (a bug, a Ctrl-C)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            return None
        if isinstance(err, OSError):
            return err
        found = _RUST_OS_ERROR.search(str(err))  # safetensors: "I/O error: No space left on device (os error 28)"
        if found:
            code = int(found[1])
            return OSError(code, os.strerror(code))
        for failure in (getattr(err, "failures", None) or {}).values():  # torch.distributed.checkpoint, per rank
            inner = os_error_of(failure[0] if isinstance(failure, tuple) else failure)
            if inner is not None:
                return inner
        err = err.__cause__ or err.__context__
    return None


def write_failure_message(os_err: OSError, path: str | os.PathLike, what: str, elsewhere: str) -> str:
    """``<what>: cannot write <path>: <strerror> (ENOSPC: the disk is full); free space there, or <elsewhere>``."""
    code = os_err.errno if isinstance(os_err.errno, int) else None
    name = errno.errorcode.get(code, "") if code is not None else ""
    meaning, first = MEANINGS.get(code, (None, "check the folder"))
    said = os_err.strerror or str(os_err)
    detail = f"{name}: {meaning}" if meaning else name
    where = os_err.filename or path
    return f"{what}: cannot write {where}: {said}" + (f" ({detail})" if detail else "") + f"; {first}, or {elsewhere}"


@contextlib.contextmanager
def writing(path: str | os.PathLike, what: str, elsewhere: str,
            error: type[PosttrainError] = DiskWriteError) -> Iterator[None]:
    """Turn a failed write inside the block into one ``error`` naming ``path`` (see `write_failure_message`);
    posttrain's own errors and everything that is not a write failure pass unchanged."""
    try:
        yield
    except PosttrainError:
        raise
    except BaseException as err:
        os_err = os_error_of(err)
        if os_err is None:
            raise
        message = write_failure_message(os_err, path, what, elsewhere)
        if issubclass(error, DiskWriteError):
            raise error(message, os_err.filename or path, os_err.errno) from err
        raise error(message) from err


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """A write failure inside the block becomes a plain `OSError` naming ``path`` (the libraries' own
    errors name no file, so the message would only name the folder)."""
    try:
        yield
    except BaseException as err:
        os_err = os_error_of(err)
        if os_err is None or isinstance(err, PosttrainError):
            raise
        raise OSError(os_err.errno, os_err.strerror, os_err.filename or os.fspath(path)) from err


def save_torch(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` through a Python file: a failed write keeps its `OSError` (errno, file name), where
    writing to a path turns it into ``RuntimeError: ... unexpected pos`` with no errno."""
    import torch

    with naming(path), open(path, "wb") as f:
        torch.save(obj, f)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``/proc/self/status``): setting
    it to read it back would, for that moment, give files other threads create the wrong mode."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def readable_as_umask_says(folder: str | os.PathLike) -> None:
    """Give every file under ``folder`` the mode a plain ``open()`` would have (``0o666 & ~umask``).

    Libraries that write atomically create their file with ``mkstemp`` and rename it (safetensors 0.8 does,
    so ``save_pretrained`` does): mode 0600 whatever the umask, a model the user's group cannot read."""
    mode = 0o666 & ~current_umask()
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, mode)


def folder_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be (or become) a folder: it, or a folder above it, is an existing file.
    None when it is a folder or can be created as one (permissions are found when writing)."""
    from pathlib import Path

    wanted = Path(path).expanduser()
    for part in (wanted, *wanted.parents):
        if part.is_dir():
            return None
        if part.exists() or part.is_symlink():
            what = "a file" if part.is_file() else "not a folder (a broken link or a special file)"
            above = "" if part == wanted else f" (a folder above {wanted})"
            return f"{part}{above} is {what}, so it cannot hold files"
    return None
