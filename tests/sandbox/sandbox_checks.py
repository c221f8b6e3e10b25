"""What every hostile-code test checks after a run: no process left, no folder left."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import subprocess
import sys
import tempfile

import pytest

from posttrain.sandbox import isolation_available
from posttrain.sandbox.local import FIRST_UID, MAX_WORKERS

MARGIN_S = 3.0  # time-out plus this: interpreter start and the sweep on a busy 2-core machine


SKIP_KEY = "POSTTRAIN_SANDBOX_TESTS"


def needs_namespaces() -> None:
    """The sandbox's isolation must work here: a machine where it does not fails the test with the probe's
    reason (a suite that skips would stay green with the feature off), unless POSTTRAIN_SANDBOX_TESTS=skip
    says this machine is known not to allow it (then a skip with the reason, which ``-rs`` prints)."""
    why_not = isolation_available()["namespaces"]
    if why_not is None:
        return
    if os.environ.get(SKIP_KEY) == "skip":
        pytest.skip(f"{SKIP_KEY}=skip and the sandbox cannot run here: {why_not}")
    pytest.fail(f"the sandbox cannot run on this machine: {why_not} (set {SKIP_KEY}=skip to skip these tests "
                "where that is expected)", pytrace=False)


def needs_own_uid() -> None:
    """RLIMIT_NPROC holds only for a uid that is not root: the runs' own uids (root + namespaces)."""
    needs_namespaces()
    if os.geteuid() != 0:
        pytest.skip("per-run uids need root; as a user RLIMIT_NPROC counts the user's processes")


def plain_run(code: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    """The negative control: ``code`` in a plain interpreter, as this process's user, with no sandbox."""
    return subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=timeout_s)


def sandbox_uids(owner_pid: int) -> range:
    """The uids `LocalSandbox` gives the workers of process ``owner_pid`` (when root)."""
    first = FIRST_UID + (owner_pid % (1 << 22)) * MAX_WORKERS
    return range(first, first + MAX_WORKERS)


def processes_with(marker: str, owner_pid: int | None = None) -> list[int]:
    """Processes whose command line holds ``marker``, or that belong to a sandboxed run of ``owner_pid``
    (this test process by default): running as one of its uids, or its runner (whose config names one)."""
    uids = sandbox_uids(os.getpid() if owner_pid is None else owner_pid)
    runner_tags = [f"'uid': {uid}," for uid in uids]
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as cmdline:
                text = cmdline.read().replace(b"\0", b" ").decode("utf-8", errors="replace")
            uid = os.stat(f"/proc/{name}").st_uid
        except OSError:
            continue
        if (marker and marker in text) or uid in uids or any(tag in text for tag in runner_tags):
            found.append(int(name))
    return found


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def sandbox_folders(owner_pid: int) -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"posttrain-sandbox-{owner_pid}-*")))


class Leftovers:
    """Context: fails when a run of ``owner_pid`` (this process by default) leaves a process (by marker,
    sandbox uid or runner) or a temporary folder."""

    def __init__(self, marker: str = "", owner_pid: int | None = None):
        self.marker = marker
        self.owner_pid = os.getpid() if owner_pid is None else owner_pid

    def __enter__(self) -> Leftovers:
        self.folders = sandbox_folders(self.owner_pid)
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            return
        left = processes_with(self.marker, self.owner_pid)
        kill_all(left)
        assert not left, f"processes outlived the run: {left}"
        new = sandbox_folders(self.owner_pid) - self.folders
        assert not new, f"the run's temporary folder was not removed: {new}"


TOKEN = "test-token-" + "0123456789abcdef" * 2  # the servers these tests start take it from the environment


def server_env(**more: str) -> dict:
    return {**os.environ, "POSTTRAIN_SANDBOX_TOKEN": TOKEN, **more}


@contextlib.contextmanager
def serving(*options: str, env: dict | None = None):
    """`posttrain sandbox serve --port 0 OPTIONS` running with token `TOKEN`; yields its /run_code URL (read
    from the line it prints); stopped with SIGTERM (exit 143), and nothing of its runs left behind."""
    process = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "sandbox", "serve", "--port", "0", *options],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or server_env())
    with Leftovers(owner_pid=process.pid):  # the server's runs: its uids, runners and folders
        line = process.stdout.readline()
        found = re.search(r"POST (http://\S+/run_code)", line)
        assert found, line + process.stderr.read()
        yield found.group(1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 143
        process.stdout.close()
        process.stderr.close()
