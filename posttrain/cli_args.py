"""Argument types for every numeric command-line flag (``type=`` of argparse).

A count or size is checked where it is read, so ``--n -3`` is refused with argparse's one-line error
(``argument --n: -3 is not valid: must be a whole number >= 1``, exit code 2) instead of reaching a
Python slice (``rows[:-3]`` drops three rows without a word). Every numeric flag of every
sub-command uses one of these types; ``tests/test_cli_args.py`` walks the parsers to keep it so.

A flag naming a file or folder to read (``--config``, ``--input``, ...) uses `file_to_read` or
`folder_to_read`, one to write `folder_to_write` or `file_to_write`, so a folder
given where a file is expected (or the reverse) is named as such, with what was expected, before any
work (``argument --config: runs/ is a folder, not a YAML config file``).

This module imports nothing from posttrain (the sandbox's parser uses it too, and the sandbox imports only
`posttrain.errors`), so any command's parser may use it.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable

__all__ = ["NUMERIC_TYPES", "PATH_TYPES", "bytes_from_text", "file_to_read", "file_to_write",
           "finite_float", "folder_to_read", "folder_to_write", "int_at_least", "int_from_to", "memory_size", "non_negative_float",
           "non_negative_int", "port_number", "positive_float", "positive_int", "probability", "yaml_config_file"]


def _refuse(text: str, valid: str) -> argparse.ArgumentTypeError:
    # argparse prefixes the flag: "argument --n: -3 is not valid: must be a whole number >= 1"
    return argparse.ArgumentTypeError(f"{text} is not valid: must be {valid}")


def _whole_number(text: str, valid: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise _refuse(repr(text), valid) from None


def _number(text: str, valid: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _refuse(repr(text), valid) from None
    if not math.isfinite(value):
        raise _refuse(text, valid)
    return value


NUMERIC_TYPES: set[Callable[[str], object]] = set()
"""Every type made here (what the parser walk in the tests accepts for a numeric flag)."""


def int_at_least(minimum: int) -> Callable[[str], int]:
    """The type of a whole-number flag whose smallest valid value is ``minimum``."""
    valid = f"a whole number >= {minimum}"

    def parse(text: str) -> int:
        value = _whole_number(text, valid)
        if value < minimum:
            raise _refuse(text, valid)
        return value

    parse.__name__ = f"int_at_least_{minimum}"
    NUMERIC_TYPES.add(parse)
    return parse


def int_from_to(minimum: int, maximum: int) -> Callable[[str], int]:
    """The type of a whole-number flag valid from ``minimum`` to ``maximum`` (an operand width)."""
    valid = f"a whole number from {minimum} to {maximum}"

    def parse(text: str) -> int:
        value = _whole_number(text, valid)
        if not minimum <= value <= maximum:
            raise _refuse(text, valid)
        return value

    parse.__name__ = f"int_from_{minimum}_to_{maximum}"
    NUMERIC_TYPES.add(parse)
    return parse


positive_int = int_at_least(1)
"""A count or size: 1, 2, ..."""
positive_int.__name__ = "positive_int"

non_negative_int = int_at_least(0)
"""A seed or a count where 0 means none: 0, 1, ..."""
non_negative_int.__name__ = "non_negative_int"


def positive_float(text: str) -> float:
    """A finite number > 0 (a temperature, a parameter count)."""
    value = _number(text, "a finite number > 0")
    if value <= 0:
        raise _refuse(text, "a finite number > 0")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (a wait in milliseconds)."""
    value = _number(text, "a finite number >= 0")
    if value < 0:
        raise _refuse(text, "a finite number >= 0")
    return value


def probability(text: str) -> float:
    """A share in (0, 1] (top-p)."""
    value = _number(text, "a number in (0, 1]")
    if not 0 < value <= 1:
        raise _refuse(text, "a number in (0, 1]")
    return value


def finite_float(text: str) -> float:
    """Any finite number (a score threshold may be negative); nan and inf are refused."""
    return _number(text, "a finite number")


def memory_size(text: str) -> float:
    """A memory size > 0 in bytes: '80GiB', '141GB', '512MiB', or a plain number of GiB ('24')."""
    valid = "a memory size > 0 such as 80GiB, 141GB or 24 (GiB)"
    try:
        value = bytes_from_text(text)
    except ValueError:
        raise _refuse(repr(text), valid) from None
    if not math.isfinite(value) or value <= 0:
        raise _refuse(text, valid)
    return value


def bytes_from_text(text: str) -> float:
    """'80GiB' -> 80 x 2**30, '141GB' -> 141e9, '80' -> 80 GiB (any sign; `memory_size` checks it)."""
    units = {"tib": 1024**4, "tb": 1e12, "gib": _GIB, "gb": 1e9, "g": _GIB, "mib": 1024**2, "mb": 1e6}
    t = text.strip().lower().replace(" ", "")
    unit = next((u for u in units if t.endswith(u)), "")
    try:
        return float(t[: len(t) - len(unit)]) * (units[unit] if unit else _GIB)
    except ValueError:
        raise ValueError(f"cannot read a memory size from {text!r}; write e.g. 80GiB, 141GB or 24") from None


_GIB = 1024**3
NUMERIC_TYPES.update((positive_float, non_negative_float, probability, finite_float, memory_size))


def port_number(text: str) -> int:
    """A TCP port: 0 (any free one) to 65535."""
    value = _whole_number(text, "a port number from 0 to 65535")
    if not 0 <= value <= 65535:
        raise _refuse(text, "a port number from 0 to 65535")
    return value


NUMERIC_TYPES.add(port_number)


PATH_TYPES: set[Callable[[str], str]] = set()
"""Every path type made here (what the parser walk in the tests accepts for a path flag)."""


def _path_type(parse: Callable[[str], str], name: str) -> Callable[[str], str]:
    parse.__name__ = name
    PATH_TYPES.add(parse)
    return parse


def file_to_read(expected: str) -> Callable[[str], str]:
    """The type of a flag naming a file to read; ``expected`` says what it holds ("a YAML config file").
    A folder is refused saying so. A path that does not exist yet is left to the command, which says so
    where it reads it: a script's later line may write it (``prep arithmetic`` before ``prep pairs``)."""
    def parse(text: str) -> str:
        if Path(text).expanduser().is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a folder, not {expected}")
        return text

    return _path_type(parse, "file_to_read")


def folder_to_read(expected: str) -> Callable[[str], str]:
    """The type of a flag naming a folder to read; ``expected`` says what it holds. A file is refused saying
    so; a missing path is left to the command (as `file_to_read`)."""
    def parse(text: str) -> str:
        path = Path(text).expanduser()
        if path.exists() and not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a file, not {expected}")
        return text

    return _path_type(parse, "folder_to_read")


def _file_in_the_way(path: Path) -> str | None:
    """Why ``path`` cannot be (or become) a folder: it, or a folder above it, is a file (as
    `posttrain.host.disk.folder_problem` says it; not imported, see the module's docstring)."""
    for part in (path, *path.parents):
        if part.is_dir():
            return None
        if part.exists() or part.is_symlink():
            above = "" if part == path else f" (a folder above {path})"
            return f"{part}{above} is a file, so it cannot hold files"
    return None


def _folder_to_write(text: str) -> str:
    """A folder to write into: an existing folder or a path that can become one (not a file)."""
    blocked = _file_in_the_way(Path(text).expanduser())
    if blocked:
        raise argparse.ArgumentTypeError(f"{blocked}; give a folder (new or existing) to write into")
    return text


folder_to_write = _path_type(_folder_to_write, "folder_to_write")


def file_to_write(expected: str) -> Callable[[str], str]:
    """The type of a flag naming a file to write (or to read when it exists and make when it does not);
    a folder, or a path under a file, is refused."""
    def parse(text: str) -> str:
        path = Path(text).expanduser()
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a folder, not {expected}")
        blocked = _file_in_the_way(path.parent)
        if blocked:
            raise argparse.ArgumentTypeError(f"{text}: {blocked}")
        return text

    return _path_type(parse, "file_to_write")


yaml_config_file = file_to_read("a YAML config file")
"""``--config`` of every command that reads a YAML file of config keys."""
