"""Nothing of a run outlives a kill -9 of its driver: the local Ray cluster it started (gcs, raylet,
workers, and the agents that used to survive) is gone within 30 s (posttrain.distributed.reaper)."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

psutil = pytest.importorskip("psutil")
pytest.importorskip("ray")

DRIVER = textwrap.dedent("""
    import time, ray
    from posttrain.distributed.cluster import connect
    connect({"num_cpus": 1, "address": "local"})

    @ray.remote(num_cpus=1)
    class Sleeper:
        def ping(self):
            return 1

    s = Sleeper.remote()
    assert ray.get(s.ping.remote()) == 1
    print("ready", flush=True)
    time.sleep(600)
""")


def _run_and_kill(reaper: bool) -> list:
    """Start a driver with its own local cluster, SIGKILL it once ready; the processes it had started
    that are still alive 30 s later (the test kills those afterwards, so nothing leaks either way)."""
    ray_tmp = tempfile.mkdtemp(prefix="pt-reap-", dir="/tmp")  # Ray's socket paths must stay short
    env = dict(os.environ, RAY_TMPDIR=ray_tmp)
    env.pop("RAY_ADDRESS", None)
    if not reaper:
        env["POSTTRAIN_NO_REAPER"] = "1"
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, env=env)
    started: list = []
    try:
        assert driver.stdout.readline().strip() == "ready"
        time.sleep(3)  # the agents start a moment after the cluster answers
        started = [p for p in psutil.Process(driver.pid).children(recursive=True)
                   if "posttrain.distributed.reaper" not in " ".join(p.cmdline())]
        assert started, "the driver started no processes"
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(started):
            time.sleep(1)
        return _alive(started)
    finally:
        driver.kill()
        for p in _alive(started):
            p.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _alive(procs: list) -> list:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.mark.slow
def test_nothing_of_the_run_survives_kill_9_of_its_driver():
    left = _run_and_kill(reaper=True)
    assert left == [], f"still alive 30 s after kill -9: {[p.name() for p in left]}"


@pytest.mark.slow
def test_negative_control_without_the_reaper_ray_processes_survive():
    left = _run_and_kill(reaper=False)
    assert left, "without the reaper something of Ray should outlive the driver (else the test above proves nothing)"
