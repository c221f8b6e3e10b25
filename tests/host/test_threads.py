"""OpenMP's wait policy chosen before torch starts, and fewer threads while other processes use the
cores (posttrain/host/threads.py)."""

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from posttrain.host import threads
from posttrain.host.threads import FreeCoreThreads, choose_wait_policy, others_busy_cores

linux_only = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads /proc")


@pytest.fixture
def no_policy(monkeypatch):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_spins_on_idle_cores_sleeps_on_busy_ones(no_policy, monkeypatch):
    monkeypatch.setattr(threads, "others_busy_cores", lambda seconds=0.1: 0.1)
    choose_wait_policy()
    assert "OMP_WAIT_POLICY" not in os.environ and threads.wait_policy_choice()[0]
    monkeypatch.setattr(threads, "others_busy_cores", lambda seconds=0.1: 0.9)
    why = choose_wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and not threads.wait_policy_choice()[0]
    assert "0.9" in why


def test_several_launched_processes_sleep(no_policy, monkeypatch):
    monkeypatch.setattr(threads, "others_busy_cores", lambda seconds=0.1: 0.0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    choose_wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_the_users_policy_is_kept(no_policy, monkeypatch):
    monkeypatch.setattr(threads, "others_busy_cores", lambda seconds=0.1: 2.0)
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    assert "GOMP_SPINCOUNT=10000" in choose_wait_policy()
    assert "OMP_WAIT_POLICY" not in os.environ and not threads.wait_policy_choice()[0]
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    choose_wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def _busy_process():
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


@linux_only
def test_counts_other_processes_not_this_one():
    """A busy child counts (its load only adds to whatever else runs, so this holds on a busy machine);
    this process's own CPU time, read from /proc/self/stat, is what the count subtracts."""
    hog = _busy_process()
    try:
        time.sleep(0.3)
        assert others_busy_cores(0.5) > 0.6
    finally:
        hog.kill()
        hog.wait()
    cpus = threads._our_cpus()
    before, cpu_before = threads._cpu_ticks(cpus), time.process_time()
    end = time.monotonic() + 0.5
    while time.monotonic() < end:  # burn this process's own CPU
        sum(range(1000))
    after, cpu_after = threads._cpu_ticks(cpus), time.process_time()
    own_s = (after[1] - before[1]) / os.sysconf("SC_CLK_TCK")
    assert abs(own_s - (cpu_after - cpu_before)) < 0.1  # the own-ticks field is this process's CPU time


def test_own_ticks_are_subtracted_from_the_cores_busy_ticks():
    """Two samples 1 s apart in which the cores were busy for 1.5 core-seconds, 1 of them this process's:
    others used 0.5 cores (negative control: without the subtraction it would read 1.5)."""
    tick = os.sysconf("SC_CLK_TCK")
    before, after = (1000, 200), (1000 + int(1.5 * tick), 200 + tick)
    assert threads._others_cores(before, after, 1.0) == pytest.approx(0.5)
    assert (after[0] - before[0]) / tick == pytest.approx(1.5)


class _FakeTicks:
    """`threads._cpu_ticks` stand-in: other processes use ``others`` cores while the clock advances."""

    def __init__(self):
        self.busy, self.others, self.last = 0, 0.0, time.monotonic()

    def __call__(self, cpus):
        now = time.monotonic()
        self.busy += int(self.others * (now - self.last) * os.sysconf("SC_CLK_TCK"))
        self.last = now
        return self.busy, 0


def test_fewer_threads_while_another_process_runs(monkeypatch):
    """Other processes on one of two cores: one thread; once they stop, two again (the samples are
    simulated, so a busy test machine cannot change the answer; /proc's reading is tested above)."""
    fake = _FakeTicks()
    monkeypatch.setattr(threads, "_cpu_ticks", fake)
    monkeypatch.setattr(threads, "_our_cpus", lambda: {0, 1})
    full = 2
    torch.set_num_threads(full)  # the suite runs on one (conftest); restored by its fixture
    lines = []
    guard = FreeCoreThreads(enabled=True, log=lambda *a, **k: lines.append(a[0]))
    try:
        fake.others = 1.0
        time.sleep(0.2)
        assert guard.adjust() == 1 == torch.get_num_threads()
        fake.others = 0.0
        time.sleep(0.2)
        assert guard.adjust() == full == torch.get_num_threads()
        assert "other processes used 1.0 of 2 cores" in lines[0]
    finally:
        torch.set_num_threads(full)
    assert FreeCoreThreads(enabled=False).adjust() == full


def test_entry_points_choose_before_torch_loads():
    """The policy is read once, when torch's OpenMP runtime starts: the entry modules must not import
    torch before `choose_wait_policy` runs."""
    code = ("import os, sys; os.environ.pop('OMP_WAIT_POLICY', None); os.environ.pop('GOMP_SPINCOUNT', None); "
            "import posttrain.cli, posttrain.trainer.main_ppo, posttrain.trainer.fsdp_sft_trainer; "
            "assert 'torch' not in sys.modules; import posttrain.host.threads as t\n"
            "calls = []; real = t.choose_wait_policy\n"
            "def spy(*a, **k):\n"
            "    calls.append('torch' in sys.modules); return real(*a, **k)\n"
            "t.choose_wait_policy = spy; sys.argv = ['posttrain', 'config', '--keys']\n"
            "import contextlib, io\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try: posttrain.cli.entry()\n"
            "    except SystemExit: pass\n"
            "print(calls)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[False]"
