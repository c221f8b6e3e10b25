"""Nothing of a run outlives it: a watcher process that ends what the run started once the run is gone.

When a run starts its own local Ray cluster, Ray's node processes are the driver's descendants (gcs_server,
raylet, and under the raylet the workers, ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent``). Killed
with SIGKILL, the driver cannot shut them down, and some of Ray's agents survive it, reparented to init.
`start_reaper` starts a small process that keeps a list of the driver's descendants (re-read every second,
each with its start time so a reused pid is never hit) and holds the read end of a pipe whose write end
only the driver has: the pipe reads end-of-file when the driver ends, however it ends, and the watcher
then kills every listed process still alive, and their children. A cluster the run merely joined is
not the driver's descendant and is never touched. ``POSTTRAIN_NO_REAPER=1`` turns it off.

    python -m posttrain.distributed.reaper DRIVER_PID     (started by `start_reaper`, reading the pipe on stdin)
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

__all__ = ["start_reaper"]

_started: subprocess.Popen | None = None


def start_reaper() -> None:
    """Start the watcher for this process (once; a no-op with ``POSTTRAIN_NO_REAPER=1``)."""
    global _started
    if _started is not None or os.environ.get("POSTTRAIN_NO_REAPER") == "1":
        return
    read_end, write_end = os.pipe()
    _started = subprocess.Popen([sys.executable, "-m", "posttrain.distributed.reaper", str(os.getpid())],
                                stdin=read_end, start_new_session=True, close_fds=True)
    os.close(read_end)
    os.set_inheritable(write_end, False)  # only this process holds it: its end is the driver's end
    _started._driver_end = write_end  # kept open for this process's life


def _descendants(pid: int) -> dict[int, float]:
    """pid -> start time of every process below ``pid`` (psutil, one of Ray's own dependencies)."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return {}
    found = {}
    for child in children:
        try:
            found[child.pid] = child.create_time()
        except psutil.Error:
            pass
    return found


def _kill(seen: dict[int, float]) -> int:
    """SIGKILL each listed process that is still the one listed, and whatever it started since."""
    import psutil

    victims = []
    for pid, started in seen.items():
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - started) > 0.01 or pid == os.getpid():
                continue
            victims.append(proc)
            victims.extend(proc.children(recursive=True))
        except psutil.Error:
            pass
    for proc in victims:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    return len(victims)


def watch(driver_pid: int, poll_s: float = 1.0) -> None:
    """Run until stdin (the driver's pipe) reads end-of-file, then kill what the driver left."""
    seen: dict[int, float] = {}
    while True:
        seen.update(_descendants(driver_pid))
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], poll_s)
        if ready and not os.read(sys.stdin.fileno(), 1):
            break
    time.sleep(0.5)  # a clean shutdown in progress gets a moment to end its own processes first
    _kill(seen)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the run's terminal is the driver's to handle
    watch(int(sys.argv[1]))
