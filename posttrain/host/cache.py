"""posttrain's cache folder: ``~/.cache/posttrain``, or ``POSTTRAIN_CACHE_DIR`` where it is set.

It holds what a later run can reuse instead of measuring or converting again: the precision that
``param_dtype=auto`` measured (``precision.json``), the fp32 product the lean decoder timed
(``fp32_matmul.json``: every run on a machine then multiplies, and so rounds, the same way) and
plain copies of GGUF models (``gguf/``).
Everything in it can be deleted; it is rebuilt on the next run that needs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["cache_root", "cpu_name", "machine_key", "read_answers", "write_answer"]


def cache_root() -> Path:
    """The cache folder (not created here)."""
    return Path(os.environ.get("POSTTRAIN_CACHE_DIR") or Path.home() / ".cache" / "posttrain")


def cpu_name() -> str:
    """The CPU's model name line from /proc/cpuinfo (on some CPUs only its flags), else the platform's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line  # the first of the two: a model name, or on some CPUs only the flags
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(*parts: str) -> str:
    """A short key for an answer measured on this CPU with these ``parts`` (versions, shapes, threads)."""
    return hashlib.sha256("|".join([cpu_name(), *parts]).encode()).hexdigest()[:16]


def read_answers(path: Path) -> dict[str, Any]:
    """The answers cached in the JSON file ``path`` ({} when there is none or it is damaged)."""
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # no cache yet, or a damaged one: measure again


def write_answer(path: Path, key: str, entry: Any) -> None:
    """Add ``key: entry`` to the JSON file ``path`` (replaced whole, so a reader never sees half a file);
    a cache that cannot be written only means measuring again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**read_answers(path), key: entry}
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the next run measures again
