"""Faults of asynchronous runs (issue 39): after kill -9 of the driver its rollout worker is gone within
30 s (it watches the driver's pid); after kill -9 of a rollout worker, or of one of the trainer's FSDP2 ranks,
the run stops within 30 s with one error line naming it, and nothing of the run is left running. Each driver runs in its own session, which the test kills afterwards (the
Ray processes a killed driver leaves are posttrain.distributed.cluster's concern, not checked here)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.tiny_run import tiny_overrides

pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[1]
WORKER_LINE = re.compile(r"rollout worker 0 pid (\d+) node (\S+)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _start_driver(tmp_path: Path, extra: tuple[str, ...] = ("ray_kwargs.ray_init.num_cpus=2",)):
    log = open(tmp_path / "driver.log", "w")
    argv = [sys.executable, "-m", "posttrain.experimental.one_step_off_policy.async_main_ppo",
            *tiny_overrides(tmp_path, ["trainer.total_training_steps=100000", *extra])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_ADDRESS": "local", "POSTTRAIN_DEBUG": ""}
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        return proc, _worker_pid_once_training(tmp_path, proc)
    except BaseException:
        _end_session(proc)
        raise


def _worker_pid_once_training(tmp_path: Path, proc) -> int:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        text = (tmp_path / "driver.log").read_text()
        found = WORKER_LINE.search(text)
        if found and "threads:" in text:  # printed as training starts
            time.sleep(5)  # a few steps in: units in flight, weights pushed
            return int(found.group(1))
        if proc.poll() is not None:
            raise AssertionError(f"the driver exited early:\n{text[-3000:]}")
        time.sleep(0.5)
    raise AssertionError("no step within 240 s:\n" + (tmp_path / "driver.log").read_text()[-3000:])


def _end_session(proc) -> None:
    """Kill what the driver's session still holds (Ray's own processes after a driver kill)."""
    for pid in _session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _session_pids(sid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:  # field 6 of /proc/pid/stat: the session id
                out.append(int(entry))
    return out


@pytest.mark.slow  # a real driver and rollout worker (~60 s on 2 busy cores)
def test_kill_driver_ends_its_rollout_worker(tmp_path):
    proc, worker = _start_driver(tmp_path)
    try:
        assert _alive(worker)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _alive(worker), "the rollout worker outlived its driver by 30 s"
    finally:
        _end_session(proc)


@pytest.mark.slow  # a real driver and rollout worker (~60 s on 2 busy cores)
def test_dead_rollout_worker_stops_the_run_with_one_line(tmp_path):
    proc, worker = _start_driver(tmp_path)
    try:
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError("the run did not stop within 30 s of its rollout worker's death") from None
        assert time.monotonic() - killed < 30
        text = (tmp_path / "driver.log").read_text()
        errors = [ln for ln in text.splitlines() if ln.startswith("error: ")]  # Ray's own log lines may follow
        assert rc == 1, text[-3000:]
        assert len(errors) == 1 and errors[0].startswith("error: rollout worker 0 (node "), text[-3000:]
        assert f"pid {worker})" in errors[0] and "died" in errors[0], errors[0]
        assert "Traceback" not in text
    finally:
        _end_session(proc)


def _rank_pids(sid: int) -> list[int]:
    """The trainer's rank processes in a driver's session (Ray titles them after the rank host actor)."""
    pids = []
    for pid in _session_pids(sid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::_RankHost"):
                    pids.append(pid)
        except OSError:
            pass
    return pids


@pytest.mark.slow  # a real driver, 2 trainer ranks and a rollout worker (~60 s on 2 busy cores)
def test_dead_trainer_rank_stops_the_run_and_its_rollout_worker(tmp_path):
    proc, worker = _start_driver(tmp_path, ("ray_kwargs.ray_init.num_cpus=3", "trainer.n_gpus_per_node=2"))
    try:
        ranks = _rank_pids(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError("the run did not stop within 30 s of a trainer rank's death") from None
        text = (tmp_path / "driver.log").read_text()
        errors = [ln for ln in text.splitlines() if ln.startswith("error: ")]
        assert rc == 1 and len(errors) == 1 and "rank" in errors[0], text[-3000:]
        assert f"pid {ranks[1]}" in errors[0], errors[0]
        while _alive(worker) and time.monotonic() - killed < 30:
            time.sleep(0.5)
        assert not _alive(worker), "the rollout worker outlived the run by 30 s"
        assert not [p for p in ranks if _alive(p)], "a trainer rank outlived the run"
    finally:
        _end_session(proc)
