"""Peak resident memory of a whole process tree: this process and every process it started (Ray
workers, torchrun ranks, reward workers), the one memory figure every stage reports.

Each process's own high-water mark (``VmHWM``) cannot be summed: the processes peak at different
times, and the trainer resets its own mark at each phase boundary (`posttrain.host.resident`). So a
background thread samples the tree's summed ``VmRSS`` every ``interval`` seconds (default 0.05 s)
and keeps the largest sum; `TreePeak.peak_bytes` also folds in this process's own high-water mark
(exact, between samples). The sum counts pages two processes share (the libraries of two Ray
workers) once per process: it errs on the high side, as a laptop's free memory does.

Command line (how the README's per-stage figures were measured, the same method from outside)::

    python -m posttrain.host.process_tree [--json FILE] -- posttrain sft ...

runs the command and prints ``peak memory: x.xx GB (process tree), wall N s``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

__all__ = ["TreePeak", "descendants", "run_peak_metrics", "start_run_peak", "tree_resident_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])  # the name may hold spaces and parentheses


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it (Linux ``/proc``; just ``[root]`` elsewhere)."""
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return [root]
    children: dict[int, list[int]] = {}
    for pid in pids:
        parent = _parent_of(pid)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def _resident_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0  # the process ended between the listing and the read


def tree_resident_bytes(root: int | None = None) -> int:
    """Summed resident set of ``root`` (default: this process) and its descendants, now."""
    return sum(_resident_bytes(pid) for pid in descendants(os.getpid() if root is None else root))


class TreePeak:
    """Largest summed resident set of a process tree while running (``start``/``stop``, or ``with``).

    The tree's members are listed again every ``rescan`` seconds (a walk over ``/proc``, a few ms);
    in between, only their ``statm`` is read (microseconds), so the thread costs well under 1% of a core.
    """

    def __init__(self, root: int | None = None, interval: float = 0.05, rescan: float = 1.0):
        self.root = os.getpid() if root is None else root
        self.interval, self.rescan = interval, rescan
        self.sampled = 0
        self._members = [self.root]
        self._listed = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> int:
        if time.monotonic() - self._listed >= self.rescan:
            self._members, self._listed = descendants(self.root), time.monotonic()
        now = sum(_resident_bytes(pid) for pid in self._members)
        self.sampled = max(self.sampled, now)
        return now

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> "TreePeak":
        self.sample()
        self._thread = threading.Thread(target=self._run, name="posttrain-tree-peak", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.peak_bytes()

    def peak_bytes(self, own_peak: int = 0) -> int:
        """The sampled peak, at least ``own_peak`` (this process's exact peak where it was kept across
        resets: `posttrain.host.resident.PhasePeaks.run_peak`) and, when the tree is this process's,
        this process's ``VmHWM`` now."""
        peak = max(self.sampled, own_peak)
        if self.root == os.getpid():
            from posttrain.host.resident import peak_resident_bytes
            peak = max(peak, peak_resident_bytes())
        return peak

    def __enter__(self) -> "TreePeak":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_run_peak: TreePeak | None = None


def start_run_peak() -> TreePeak:
    """This process's tree sampled from now on (once per process; later calls return the same sampler):
    started where a run is set up, before its models load."""
    global _run_peak
    if _run_peak is None or _run_peak.root != os.getpid():  # a forked child samples its own tree
        _run_peak = TreePeak().start()
    return _run_peak


def run_peak_metrics(own_peak: int = 0, announce: bool = True) -> dict[str, float]:
    """``memory/tree_peak_gb``: the run's process-tree peak so far (`start_run_peak`; started here when
    nothing had started it), logged with every step; ``announce`` prints it as the run's one memory line."""
    peak = start_run_peak().peak_bytes(own_peak) / 1e9
    if announce:
        print(f"peak memory: {peak:.2f} GB (process tree)", flush=True)
    return {"memory/tree_peak_gb": peak}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = None
    if argv[:1] == ["--json"]:
        out, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m posttrain.host.process_tree [--json FILE] -- COMMAND ...", file=sys.stderr)
        return 2
    began = time.monotonic()
    proc = subprocess.Popen(argv)
    peak = TreePeak(proc.pid, interval=0.1).start()
    rc = proc.wait()
    peak.stop()
    wall = time.monotonic() - began
    print(f"peak memory: {peak.sampled / 1e9:.2f} GB (process tree), wall {wall:.0f} s, exit {rc}: "
          f"{' '.join(argv)}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"peak_gb": peak.sampled / 1e9, "wall_s": wall, "rc": rc, "command": argv,
                       "loadavg": os.getloadavg()}, f)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
