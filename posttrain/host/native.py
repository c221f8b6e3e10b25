"""C kernels of this package, built once per machine with the system's C compiler and loaded with ctypes.

A kernel is a ``.c`` file beside this one. Its shared library is built for this CPU (``-march=native``)
into ``<cache>/kernels/`` (`posttrain.host.cache.cache_root`) under a name that hashes the source, the
compiler, the flags and the CPU's model and flags, so an edited source, another compiler or another CPU
(a cache folder shared by a cluster's nodes) never loads a stale or foreign build. A build takes about
a second; two processes building at once each write their own file and rename it into place.

Why not ``torch.compile`` for the same fusion: inductor fused the torch form of the 8-bit update
(`posttrain.host.adamw8bit._update_blocks`) to 0.16 s for 56M values (0.29 s eager; this kernel 0.10 s),
but importing and running it kept ~0.16 GB more resident for the rest of the run and took 2-18 s at
start-up, and its graph recompiled each step unless the step size was kept out of any ``alpha=``.

`load` returns None, with the reason in `last_error`, where there is no C compiler or the build fails:
the caller keeps its torch code (the same arithmetic, slower) and says so.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from posttrain.host.cache import cache_root

__all__ = ["FLAGS", "load", "last_error"]

FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
"""``-ffp-contract=off``: the compiler fuses no multiply-add of its own, so each operation rounds as in torch's
elementwise kernels (a kernel writes ``fmaf`` where torch's own kernel fuses); ``-fno-math-errno``: ``sqrtf``
becomes one vector instruction (nothing here reads errno)."""

last_error: dict[str, str] = {}
"""Why `load` returned None, per kernel name."""

_loaded: dict[str, ctypes.CDLL | None] = {}


def load(name: str) -> ctypes.CDLL | None:
    """The library built from ``<name>.c`` beside this file (built now if this machine has none yet), or
    None when it cannot be built (`last_error` says why)."""
    if name not in _loaded:
        _loaded[name] = _build_and_load(name)
    return _loaded[name]


def _build_and_load(name: str) -> ctypes.CDLL | None:
    source = Path(__file__).with_name(f"{name}.c")
    asked = os.environ.get("CC", "cc")
    compiler = shutil.which(asked)
    if compiler is None:
        last_error[name] = f"no C compiler ({asked!r} is not on PATH)"
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("|".join([source.read_text(), compiler, version, *FLAGS, _cpu_flags()]).encode())
        library = cache_root() / "kernels" / f"{name}-{key.hexdigest()[:16]}.so"
        if not library.exists():
            library.parent.mkdir(parents=True, exist_ok=True)
            partial = library.with_suffix(f".tmp{os.getpid()}.so")
            built = subprocess.run([compiler, *FLAGS, "-o", str(partial), str(source), "-lm"],
                                   capture_output=True, text=True, timeout=300)
            if built.returncode != 0:
                partial.unlink(missing_ok=True)
                last_error[name] = f"{compiler} failed on {source.name}: {built.stderr.strip()[-500:]}"
                return None
            os.replace(partial, library)
        return ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as error:
        last_error[name] = f"building {source.name} failed: {error}"
        return None


def _cpu_flags() -> str:
    """The CPU's model name and feature flags (what ``-march=native`` compiled for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return "|".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
