"""Stopping a real training process (`python -m posttrain.trainer.main_ppo ...`; later runs are
forked from a forkserver that preloaded the imports and call the same `main_ppo.main(argv)`).

SIGTERM / SIGINT: the step in flight finishes, a complete checkpoint is saved at that step, the
resume command is printed, the process exits 128 + the signal; the same command resumes from there.
SIGKILL (nothing can be saved) at moments when a checkpoint is being written: the next run resumes
from the latest committed (tracked) checkpoint, which is always complete, and finishes.
"""

import multiprocessing
import multiprocessing.forkserver
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from posttrain.config import load_config
from posttrain.checkpoint import CheckpointManager, verify_checkpoint
from helpers.tiny_run import one_thread, run_main_ppo, tiny_overrides
from posttrain.trainer.trainer import RLTrainer


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield

REPO = Path(__file__).resolve().parents[2]
LONG_RUN = ["trainer.total_training_steps=40", "trainer.logger=[console,file]", "trainer.resume_mode=auto"]
STEP_LINE = re.compile(r"^step (\d+)/40 ")


class _Run:
    """A training process whose output lines are collected as they come."""

    lines: list[str]

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def steps(self) -> list[int]:
        return [int(m[1]) for line in list(self.lines) if (m := STEP_LINE.match(line))]

    def wait_for(self, predicate, timeout: float = 120.0, poll: float = 0.02):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._collect()
            value = predicate()
            if value:
                return value
            if self.returncode() is not None:
                self._collect()
                pytest.fail(f"training exited early (rc {self.returncode()}):\n{self.output[-3000:]}")
            time.sleep(poll)
        self.kill()
        pytest.fail(f"timed out waiting; output so far:\n{self.output[-3000:]}")

    def _collect(self):
        pass


class Run(_Run):
    """`python -m posttrain.trainer.main_ppo ...` as a real subprocess (the user's command)."""

    def __init__(self, overrides: list[str]):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "posttrain.trainer.main_ppo", *overrides], cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.pid = self.proc.pid
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def returncode(self):
        return self.proc.poll()

    def finish(self, timeout: float = 60.0) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"did not exit within {timeout}s:\n{self.output[-3000:]}")
        self.reader.join(5)
        return rc

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.reader.join(5)


@pytest.fixture(scope="module")
def forkserver():
    """A multiprocessing forkserver that has imported torch and posttrain once: each run forked from
    it starts in about a second instead of ~8 s of imports, and runs `main_ppo.main(argv)`, the
    function `python -m posttrain.trainer.main_ppo` calls."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["posttrain.trainer.trainer", "posttrain.trainer.main_ppo", "transformers"])
    multiprocessing.forkserver.ensure_running()  # returns at once; the imports run meanwhile
    return ctx


class ForkRun(_Run):
    def __init__(self, ctx, overrides: list[str], log: Path):
        self.log = log
        self.proc = ctx.Process(target=run_main_ppo, args=(overrides, str(log)))
        self.proc.start()
        self.pid = self.proc.pid
        self.lines = []

    def _collect(self):
        if self.log.exists():
            self.lines = self.log.read_text(errors="replace").splitlines()

    def returncode(self):
        return self.proc.exitcode

    def finish(self, timeout: float = 60.0) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            self.kill()
            pytest.fail(f"did not exit within {timeout}s:\n{self.output[-3000:]}")
        self._collect()
        return self.proc.exitcode

    def kill(self):
        if self.proc.exitcode is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join()
        self._collect()


def _stop_with(run: Run, sig: signal.Signals) -> int:
    """Send `sig` once the run's first step line is out; returns the step it stopped after."""
    run.wait_for(run.steps)
    os.kill(run.pid, sig)
    assert run.finish() == 128 + sig, run.output[-3000:]  # a pre-empted run is not a finished one
    out = run.output
    assert f"received {sig.name}" in out
    found = re.search(rf"stopped by {sig.name} after step (\d+); checkpoint saved to (\S+)\.\n", out)
    assert found, out[-3000:]
    assert "Resume with the same command (trainer.resume_mode=auto" in out
    assert f"trainer.resume_mode=resume_path trainer.resume_from_path={found[2]}" in out
    stopped = int(found[1])
    assert run.steps()[-1] == stopped  # the step in flight finished and was logged; no step after it
    return stopped


def _assert_checkpoint_at(root: Path, step: int) -> None:
    manager = CheckpointManager(root)
    latest = manager.latest()
    assert latest == manager.step_dir(step) and manager.tracked_step() == step
    manifest = verify_checkpoint(latest)
    assert manifest["step"] == step and manifest["roles"] == ["actor"]
    assert '"global_step": %d' % step in (latest / "extra_state.json").read_text()


def test_sigterm_then_sigint_save_and_resume(tmp_path, forkserver):
    overrides = tiny_overrides(tmp_path, LONG_RUN)
    root = tmp_path / "ckpt"

    first = Run(overrides)
    stopped = _stop_with(first, signal.SIGTERM)
    assert stopped in (1, 2)  # the signal came after step 1's line: step 1 or (if it had begun) step 2
    _assert_checkpoint_at(root, stopped)

    second = ForkRun(forkserver, overrides, tmp_path / "second.log")  # the same command resumes
    again = _stop_with(second, signal.SIGINT)
    assert f"resumed from {root / f'global_step_{stopped}'} at step {stopped}" in second.output
    assert second.steps()[0] == stopped + 1
    assert again in (stopped + 1, stopped + 2)
    _assert_checkpoint_at(root, again)

    trainer = RLTrainer(load_config(overrides=overrides + [f"trainer.total_training_steps={again + 1}",
                                                           "trainer.logger=[file]"]))
    history = trainer.fit()
    assert [row["step"] for row in history] == [again + 1]
    assert trainer.global_step == again + 1


def _scratch(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if p.name.startswith((".tmp_global_step_", ".old_", ".trash_"))]


def test_sigkill_while_saving_resumes_from_latest_complete(tmp_path, forkserver):
    """Each run saves every step; it is killed with SIGKILL as soon as a save's scratch folder
    appears (plus a random delay of up to a few ms, so the kill lands at different points of the
    save), or at a random moment of a step. Every following run must resume from the tracked
    checkpoint, which must be complete and at most one step behind the newest complete folder (a
    kill between the folder's rename and the tracker's update leaves it one behind)."""
    rng = random.Random(1234)
    overrides = tiny_overrides(tmp_path, LONG_RUN + ["trainer.save_freq=1"])
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root)
    previous = None
    for attempt in range(3):
        run = ForkRun(forkserver, overrides, tmp_path / f"run{attempt}.log")
        if attempt == 1:  # at a random moment after the first step of this run
            run.wait_for(run.steps)
            time.sleep(rng.uniform(0.0, 0.5))
        else:  # while a checkpoint is being written (not this run's first: one is already complete)
            run.wait_for(run.steps)
            run.wait_for(lambda: root.is_dir() and any(n.startswith(".tmp_global_step_") for n in _scratch(root)),
                         poll=0.001)
            time.sleep(rng.uniform(0.0, 0.005))
        run.kill()
        assert run.returncode() == -signal.SIGKILL
        if previous is not None:
            assert f"resumed from {previous} at step {int(previous.name.split('_')[-1])}" in run.output

        latest = manager.latest()
        assert latest is not None, run.output[-3000:]
        step = verify_checkpoint(latest)["step"]
        assert latest == manager.step_dir(step) and manager.tracked_step() == step
        complete = [int(p.name.split("_")[-1]) for p in manager.step_dirs() if _is_complete(p)]
        assert max(complete) - 1 <= step <= max(complete)
        previous = latest

    step = int(previous.name.split("_")[-1])
    trainer = RLTrainer(load_config(overrides=overrides + [f"trainer.total_training_steps={step + 2}",
                                                           "trainer.logger=[file]"]))
    history = trainer.fit()
    assert [row["step"] for row in history] == [step + 1, step + 2]
    assert verify_checkpoint(manager.latest())["step"] == step + 2
    assert _scratch(root) == []  # leftovers of the killed saves were cleaned by the next save
    assert (root / "hf_model" / "config.json").exists()  # the finished run exported its actor


def _is_complete(path: Path) -> bool:
    try:
        verify_checkpoint(path)
        return True
    except Exception:
        return False


def test_two_sigints_at_once_are_one_request_and_the_checkpoint_is_saved(tmp_path, forkserver):
    """A wrapper that forwards the terminal's Ctrl-C delivers SIGINT twice within a millisecond: that is one
    request to stop (the step finishes, a checkpoint is saved, the same command resumes), not an abort."""
    overrides = tiny_overrides(tmp_path, LONG_RUN)
    root = tmp_path / "ckpt"
    run = Run(overrides)
    run.wait_for(run.steps)
    os.kill(run.pid, signal.SIGINT)
    time.sleep(0.02)  # apart enough that the run's handler sees two signals (at once, the kernel may merge them)
    os.kill(run.pid, signal.SIGINT)
    assert run.finish() == 128 + signal.SIGINT, run.output[-3000:]
    assert "aborted without saving" not in run.output
    found = re.search(r"stopped by SIGINT after step (\d+); checkpoint saved to ", run.output)
    assert found, run.output[-3000:]
    stopped = int(found[1])
    _assert_checkpoint_at(root, stopped)

    resumed = ForkRun(forkserver, overrides + ["trainer.total_training_steps=" + str(stopped + 1)],
                      tmp_path / "resumed.log")
    assert resumed.finish() == 0, resumed.output[-3000:]
    assert f"resumed from {root / f'global_step_{stopped}'} at step {stopped}" in resumed.output


def test_a_later_second_signal_still_aborts(monkeypatch):
    """Past `REPEAT_WINDOW_S` a second signal is the user asking again: abort without saving."""
    from posttrain.trainer import run as run_module

    clock = [100.0]
    monkeypatch.setattr(run_module.time, "monotonic", lambda: clock[0])
    loop = type("Loop", (), {"stop_signal": None, "phase": "train",
                             "stage": type("Stage", (), {"global_step": 3})()})()
    stop = run_module._StopOnSignals(loop)
    stop._handler(signal.SIGINT, None)
    assert loop.stop_signal == signal.SIGINT
    clock[0] += 0.001
    stop._handler(signal.SIGINT, None)  # the same Ctrl-C, forwarded: ignored
    clock[0] += run_module.REPEAT_WINDOW_S
    with pytest.raises(KeyboardInterrupt):
        stop._handler(signal.SIGINT, None)
