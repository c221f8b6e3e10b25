"""What a sandboxed run may use (`Limits`) and how it ended (`RunResult`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from posttrain.errors import ConfigError

ISOLATION_CHOICES = ("auto", "namespaces", "bwrap", "none")
# (lowest, highest) accepted for each numeric limit; a value outside is a config error, not a clamp.
RANGES = {"timeout_s": (0.1, 3600.0), "cpu_s": (1, 3600), "memory_mb": (32, 1 << 20), "max_processes": (1, 4096),
          "max_file_mb": (1, 1 << 20), "max_open_files": (16, 1 << 16), "max_output_chars": (1, 1 << 26),
          "max_output_bytes": (1024, 1 << 34), "max_folder_mb": (1, 1 << 20)}


@dataclass(frozen=True)
class Limits:
    """Per-run limits. ``memory_mb`` bounds the whole run (its processes' memory and its tmpfs pages) in a
    memory cgroup of its own where one can be made, and each process's address space (RLIMIT_AS) always;
    without a cgroup only the latter holds, and `LocalSandbox` cuts ``max_processes`` to fit (its line says). ``max_processes`` is RLIMIT_NPROC: it counts processes *and threads* of the uid the code runs
    as (a uid of its own per worker when the training process is root; otherwise the user's own, so the
    user's other processes count too and `LocalSandbox` adds their number). ``max_output_bytes`` is how
    much one run may print in all before it is stopped (status "output"); below it, stdout and stderr are
    kept to ``max_output_chars`` characters each. ``max_folder_mb`` caps the working folder as a whole,
    and the run's own /dev/shm the same (namespaces only, where both are tmpfs, i.e. RAM: up to twice
    this per run; without them only ``max_file_mb``, per file, holds)."""

    timeout_s: float = 10.0
    cpu_s: int | None = None
    memory_mb: int = 1024
    max_processes: int = 32
    max_file_mb: int = 64
    max_open_files: int = 64
    max_output_chars: int = 8192
    network: bool = False
    isolation: str = "auto"
    max_output_bytes: int = 1 << 20
    max_folder_mb: int = 256

    def __post_init__(self) -> None:
        problems = [f"{name}={getattr(self, name)!r} (valid: {low} to {high})" for name, (low, high) in RANGES.items()
                    if getattr(self, name) is not None and not low <= getattr(self, name) <= high]
        if self.isolation not in ISOLATION_CHOICES:
            problems.append(f"isolation={self.isolation!r} (valid: {', '.join(ISOLATION_CHOICES)})")
        if problems:
            raise ConfigError("sandbox limits out of range: " + "; ".join(problems))

    @property
    def cpu_seconds(self) -> int:
        """RLIMIT_CPU's soft limit: ``cpu_s``, else one second past the wall-clock time-out."""
        return self.cpu_s if self.cpu_s is not None else math.ceil(self.timeout_s) + 1

    def replace(self, **changes) -> Limits:
        return dataclasses.replace(self, **changes)


@dataclass
class RunResult:
    """How one run ended. ``status``: "ok" (exit 0), "error" (non-zero exit), "timeout" (wall clock),
    "cpu" (CPU seconds), "memory" (address space), "file_size" (a file grew past ``max_file_mb``),
    "processes" (``max_processes`` reached), "output" (printed past ``max_output_bytes``), "killed" (ended
    by a signal for another reason) or "sandbox_error" (the sandbox itself failed; the code may not have
    run). ``limit_hit`` names, in words, the limit or rule that ended or blocked the run (also the network
    and read-only file system when the code tripped on them, and processes killed after it exited)."""

    status: str
    stdout: str
    stderr: str
    return_code: int | None
    wall_s: float
    limit_hit: str | None = None
    truncated: bool = False

    def as_tool_text(self) -> str:
        """What the model reads: stdout, then stderr, then one line naming the limit hit."""
        parts = [text.rstrip("\n") for text in (self.stdout, self.stderr) if text.strip()]
        if self.truncated:
            parts.append("(output truncated)")
        if self.limit_hit:
            parts.append(f"[sandbox: {self.limit_hit}]")
        elif self.status == "error" and self.return_code is not None and not self.stderr.strip():
            parts.append(f"[sandbox: exit code {self.return_code}]")
        return "\n".join(parts)
