"""Resident memory (RSS) of this process: now, at its peak, and at its peak within each phase of a step.

Read from Linux's ``/proc/self/status`` (``VmRSS`` now, ``VmHWM`` the high-water mark). The
high-water mark is reset at each phase boundary (``/proc/self/clear_refs``, Linux >= 4.0), so a
phase's figure is the most this process held *during that phase*; `PhasePeaks` folds every reading
into the run's peak, so no reset loses it. Elsewhere (macOS, a kernel that refuses the reset) the
peak comes from ``resource.getrusage`` and cannot be reset: each phase then reports the process's
peak up to the end of that phase (`PhasePeaks.resettable` says which).

Each process measures itself: in a run with Ray ranks, every rank keeps its own `PhasePeaks`
(`posttrain.distributed.rank.RankWorker`).
"""

from __future__ import annotations

import contextlib
import resource
import sys
from typing import Iterator

__all__ = ["GB", "PhasePeaks", "current_resident_bytes", "peak_resident_bytes", "reset_peak"]

GB = 1e9
_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_RESET_HWM = "5"  # clear_refs value that resets VmHWM to the current RSS (proc(5))


def _status_kib(field: str) -> int | None:
    """``field`` of /proc/self/status in KiB, or None off Linux."""
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_resident_bytes() -> int | None:
    """Resident set size now (``VmRSS``); None where /proc is not available."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_resident_bytes() -> int:
    """Highest resident set size since start (or since the last `reset_peak`): ``VmHWM``, else
    ``getrusage``'s ``ru_maxrss`` (KiB on Linux, bytes on macOS)."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024


def reset_peak() -> bool:
    """Reset the high-water mark to the current RSS; False where the kernel does not allow it."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write(_RESET_HWM)
        return True
    except OSError:
        return False


class PhasePeaks:
    """Peak resident memory of each named phase, and of the whole run, for this process.

    ``with peaks("gen"): ...`` records the most resident during the block; phases may nest (the
    step around its phases), and a phase entered twice in a step keeps its larger peak.
    `take_metrics` returns ``memory/resident_gb/<phase>`` for the phases since its last call, plus
    ``memory/peak_resident_gb`` (the run's peak so far), and starts the next step's phases.
    """

    def __init__(self):
        self.run_peak = peak_resident_bytes()  # the process's peak so far (loading the models), before any reset
        self.resettable = reset_peak()
        self.phases: dict[str, int] = {}
        self._open: list[list] = []  # [name, peak so far] of the phases entered and not yet left

    def _fold(self) -> None:
        """Fold the high-water mark since the last reset into the open phases and the run's peak, then reset."""
        peak = peak_resident_bytes()
        self.run_peak = max(self.run_peak, peak)
        for entry in self._open:
            entry[1] = max(entry[1], peak)
        if self.resettable:
            self.resettable = reset_peak()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._fold()
        entry = [name, current_resident_bytes() or 0]
        self._open.append(entry)
        try:
            yield
        finally:
            self._fold()
            self._open.remove(entry)
            self.phases[name] = max(self.phases.get(name, 0), entry[1])

    def take_metrics(self) -> dict[str, float]:
        """The phases recorded since the last call and the run's peak, in GB (1e9 bytes)."""
        self._fold()
        out = {f"memory/resident_gb/{name}": peak / GB for name, peak in self.phases.items()}
        out["memory/peak_resident_gb"] = self.run_peak / GB
        self.phases = {}
        return out
