"""What this CPU can compute in: a probe of the machine, read from ``/proc/cpuinfo``."""

from __future__ import annotations

from pathlib import Path

__all__ = ["BF16_FLAGS", "cpu_bf16_support"]

BF16_FLAGS = {"x86": ("amx_bf16", "avx512_bf16"), "arm": ("bf16",)}
"""CPU flags that mean bf16 instructions (matrix or vector)."""


def cpu_bf16_support(cpuinfo: str | None = None) -> tuple[bool, str]:
    """(whether this CPU has bf16 instructions, the flags that say so or a sentence saying none do).

    ``cpuinfo``: the text of ``/proc/cpuinfo`` (read here when None; elsewhere, e.g. macOS, the
    answer is "unknown", treated as capable so that the measurement decides)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True, "CPU flags unknown on this system"
    words = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):  # x86 / ARM
            words.update(line.split(":", 1)[-1].split())
    if not words:
        return True, "CPU flags unknown on this system"
    found = [flag for flags in BF16_FLAGS.values() for flag in flags if flag in words]
    if found:
        return True, "this CPU has " + " and ".join(found)
    wanted = " / ".join(f for flags in BF16_FLAGS.values() for f in flags)
    return False, f"this CPU has no bf16 instructions ({wanted}), so bf16 would be emulated, many times slower"
