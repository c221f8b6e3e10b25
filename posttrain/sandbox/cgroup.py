"""A memory cgroup per sandboxed run, so ``memory_mb`` bounds the whole run (every process it starts, and
what it writes to its tmpfs folder and /dev/shm), not each process's address space.

The cgroup is made under this process's own memory cgroup (cgroup v1's ``memory`` hierarchy, or v2
where the ``memory`` controller is enabled for children), which needs write access there: root, or a
delegated cgroup. Where none can be made, `memory_cgroups` says why and the sandbox falls back to the
per-process RLIMIT_AS and says so in its isolation line.
"""

from __future__ import annotations

import os
import time
from functools import lru_cache
from pathlib import Path

__all__ = ["RunCgroup", "memory_cgroups"]


def _mounts() -> list[tuple[str, str, str, str]]:
    """(root within the hierarchy, mount point, file-system type, super options) of every mount."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as table:
        for line in table:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3:
                found.append((fields[3], fields[4].encode().decode("unicode_escape"), tail[0], tail[2]))
    return found


def _own_cgroups() -> dict[str, str]:
    """{controller list (v1) or "" (v2): this process's cgroup path} from /proc/self/cgroup."""
    found = {}
    with open("/proc/self/cgroup", encoding="utf-8") as listing:
        for line in listing:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            found[controllers] = path
    return found


def _under(mount_root: str, mount_point: str, path: str) -> Path | None:
    if path != mount_root and not path.startswith(mount_root.rstrip("/") + "/"):
        return None
    return Path(mount_point, path[len(mount_root):].lstrip("/"))


def _parent_folder() -> tuple[Path | None, int, str]:
    """(folder to make run cgroups in, cgroup version, why none)."""
    own = _own_cgroups()
    mounts = _mounts()
    for root, point, fstype, options in mounts:
        if fstype == "cgroup" and "memory" in options.split(","):
            path = next((p for c, p in own.items() if "memory" in c.split(",")), None)
            folder = _under(root, point, path) if path is not None else None
            if folder is not None and folder.is_dir():
                return folder, 1, ""
    for root, point, fstype, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            folder = _under(root, point, own[""])
            if folder is None or not folder.is_dir():
                continue
            if "memory" not in (folder / "cgroup.subtree_control").read_text().split():
                return None, 2, (f"the memory controller is not enabled for children of {folder} "
                                 "(cgroup v2 allows it only in a cgroup without processes of its own)")
            return folder, 2, ""
    return None, 0, "no memory cgroup hierarchy is mounted"


@lru_cache(maxsize=None)
def memory_cgroups() -> tuple[str | None, int, str | None]:
    """(folder run cgroups go in, cgroup version, None) where a run cgroup can be made and limited, else
    (None, 0, why not); probed once per process by making one."""
    try:
        folder, version, why = _parent_folder()
        if folder is None:
            return None, 0, why
        probe = RunCgroup(str(folder), version, f"posttrain-sandbox-probe-{os.getpid()}")
        probe.create(64)
        probe.remove()
    except OSError as error:
        return None, 0, f"cannot make a memory cgroup ({error.strerror or error}: {error.filename or ''})"
    return str(folder), version, None


class RunCgroup:
    """One run's memory cgroup: created with its limit, joined by the runner (``procs_file``), read for
    out-of-memory kills and the peak, removed after the run."""

    def __init__(self, parent: str, version: int, name: str):
        self.path = Path(parent, name)
        self.version = version
        self.procs_file = str(self.path / "cgroup.procs")

    def create(self, memory_mb: int) -> None:
        if self.path.is_dir():  # a run of a process that died and had this pid: empty, as its runs are gone
            self.remove()
        self.path.mkdir(mode=0o755)
        try:
            limit = str(memory_mb << 20)
            if self.version == 1:
                self._write("memory.limit_in_bytes", limit)
                self._write("memory.memsw.limit_in_bytes", limit, optional=True)  # swap accounting on
                self._write("memory.swappiness", "0", optional=True)
            else:
                self._write("memory.max", limit)
                self._write("memory.swap.max", "0", optional=True)
        except OSError:
            self.remove()
            raise

    def _write(self, name: str, value: str, optional: bool = False) -> None:
        try:
            (self.path / name).write_text(value)
        except (FileNotFoundError, PermissionError):
            if not optional:
                raise

    def oom_kills(self) -> int:
        """Processes the kernel killed in this cgroup for going over its limit."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
            if self.version == 1:  # kernels before 4.13 count no kills: the limit was reached at least
                return int((self.path / "memory.failcnt").read_text())
        except (OSError, ValueError):
            pass
        return 0

    def peak_mb(self) -> float | None:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text()) / (1 << 20)
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        """rmdir, retried while the last process is being torn down (EBUSY), up to 2 s."""
        deadline = time.monotonic() + 2.0
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.005)
