"""OpenMP's wait policy chosen before torch starts, from whether other processes are using the cores.

torch's CPU kernels run on an OpenMP pool (libgomp). By default a thread that reaches the end of a
parallel op spins for a while before it sleeps, so the next op finds it awake; with
``OMP_WAIT_POLICY=PASSIVE`` it sleeps at once and every parallel op pays a wake-up. A decoding step
is thousands of small ops, so the choice is large, and it goes both ways:

- on a quiet machine spinning is faster (small ops find their threads awake);
- beside one busy process it is slower, because a spinning thread burns the core its descheduled
  peer needs; one thread then beats two that spin.

The figures: ``benchmarks/bench_threads.py`` and benchmarks/README.md ("Host").

So :func:`choose_wait_policy` looks before torch loads: when the cores this process may use were
idle for a moment (other processes used less than half a core), OpenMP keeps its default (spin,
then sleep); otherwise, and in each of several processes ``torchrun`` started on one node, it sets
``PASSIVE``. A process that chose to spin then checks before each
phase of a run (:class:`FreeCoreThreads`): while other processes use the cores, torch runs as many
threads as they leave free, so no thread spins for a peer that is not running. A policy the user
set (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``) is kept as it is, with the thread count.
"""

from __future__ import annotations

import os
import time

__all__ = ["BUSY_CORES", "FreeCoreThreads", "choose_wait_policy", "others_busy_cores", "wait_policy_choice"]

BUSY_CORES = 0.5
"""Other processes using at least this many of our cores (averaged over the sample) make the machine busy."""

USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

_choice: dict[str, object] = {"spinning": False, "why": "not chosen (posttrain.host.threads.choose_wait_policy not called)"}


def _our_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # off Linux
        return set(range(os.cpu_count() or 1))


def _cpu_ticks(cpus: set[int]) -> tuple[int, int] | None:
    """(busy clock ticks of ``cpus`` since boot, this process's own CPU ticks), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and not line.startswith("cpu ")]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except OSError:
        return None
    busy = 0
    for fields in lines:
        if int(fields[0][3:]) in cpus:  # user nice system idle iowait irq softirq steal: all but idle/iowait
            busy += sum(int(v) for v in fields[1:4]) + sum(int(v) for v in fields[6:9])
    return busy, int(own[11]) + int(own[12])  # utime + stime of every thread of this process


def others_busy_cores(seconds: float = 0.1, cpus: set[int] | None = None) -> float | None:
    """Cores of ``cpus`` (default: those this process may run on) that other processes used, on
    average, over the next ``seconds``; None where ``/proc`` cannot say (not Linux)."""
    cpus = cpus or _our_cpus()
    first = _cpu_ticks(cpus)
    start = time.monotonic()
    time.sleep(seconds)
    second = _cpu_ticks(cpus)
    if first is None or second is None:
        return None
    return _others_cores(first, second, time.monotonic() - start)


def _others_cores(before: tuple[int, int], after: tuple[int, int], seconds: float) -> float:
    """Cores other processes used on average between two `_cpu_ticks` samples ``seconds`` apart:
    the cores' busy ticks less this process's own."""
    ticks = (after[0] - before[0]) - (after[1] - before[1])
    return max(ticks, 0) / os.sysconf("SC_CLK_TCK") / seconds


def choose_wait_policy(sample_seconds: float = 0.1) -> str:
    """Spin (OpenMP's default) when the cores were idle for ``sample_seconds``, else set
    ``OMP_WAIT_POLICY=PASSIVE``; a policy the user set is kept. Must run before torch is imported
    (the runtime reads the variable once, when it loads); child processes (Ray ranks) inherit it.
    Returns the reason, also kept for :func:`wait_policy_choice`."""
    user = {name: os.environ[name] for name in USER_SETTINGS if os.environ.get(name)}
    siblings = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)  # torchrun's processes on this node
    if user:
        _remember(False, "as set: " + ", ".join(f"{k}={v}" for k, v in user.items()))
    elif siblings > 1:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        _remember(False, f"sleeping waits (OMP_WAIT_POLICY=PASSIVE): {siblings} launched processes share this node")
    else:
        busy = others_busy_cores(sample_seconds)
        if busy is None:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
            _remember(False, "sleeping waits (OMP_WAIT_POLICY=PASSIVE): /proc cannot say whether the cores are shared")
        elif busy >= BUSY_CORES:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
            _remember(False, f"sleeping waits (OMP_WAIT_POLICY=PASSIVE): other processes were using {busy:.1f} "
                             "of this process's cores")
        else:
            _remember(True, "spinning waits (OpenMP's default): the cores were idle; fewer threads while other "
                            "processes use them")
    return str(_choice["why"])


def _remember(spinning: bool, why: str) -> None:
    _choice.update(spinning=spinning, why=why)


def wait_policy_choice() -> tuple[bool, str]:
    """(whether this process chose to spin, why) from :func:`choose_wait_policy`."""
    return bool(_choice["spinning"]), str(_choice["why"])


class FreeCoreThreads:
    """While other processes use this process's cores, torch threads only on the cores they leave free.

    For a process whose OpenMP threads spin (:func:`choose_wait_policy` found the cores idle):
    :meth:`adjust`, called before each phase, measures what other processes used since the last
    call and sets ``torch.set_num_threads`` to the cores left (at least 1), or back to the starting
    count once they stop. Does nothing when ``enabled`` is false.
    """

    def __init__(self, enabled: bool, log=print):
        import torch

        self.enabled, self.log = enabled, log
        self.cpus = _our_cpus()
        self.full = torch.get_num_threads()
        self._last = (_cpu_ticks(self.cpus), time.monotonic())

    def adjust(self) -> int:
        """Set and return the thread count for the next phase."""
        import torch

        if not self.enabled:
            return torch.get_num_threads()
        ticks, now = _cpu_ticks(self.cpus), time.monotonic()
        (before, then), self._last = self._last, (ticks, now)
        if ticks is None or before is None or now - then < 0.05:
            return torch.get_num_threads()
        others = _others_cores(before, ticks, now - then)
        want = self.full if others < BUSY_CORES else max(1, min(self.full, round(len(self.cpus) - others)))
        if want != torch.get_num_threads():
            torch.set_num_threads(want)
            self.log(f"threads: {want} of {self.full} (other processes used {others:.1f} of {len(self.cpus)} cores "
                     "since the last phase)", flush=True)
        return want
