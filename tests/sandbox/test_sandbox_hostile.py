"""Hostile code in the local sandbox: each case ends in a RunResult naming the limit hit, within the
time-out plus a margin, with no process or folder left behind; each has a negative control that shows
the same code gets through once that limit is lifted (so the test would fail without it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
from sandbox_checks import (MARGIN_S, Leftovers, kill_all, needs_namespaces, needs_own_uid, plain_run,
                            processes_with)

from posttrain.sandbox import Limits, LocalSandbox


def run(code: str, marker: str = "", **limits):
    """Run ``code`` in a fresh sandbox; (result, seconds), after checking nothing was left."""
    sandbox = LocalSandbox(Limits(**limits), num_workers=1)
    with Leftovers(marker):
        start = time.monotonic()
        result = sandbox.run(code)
        elapsed = time.monotonic() - start
    return result, elapsed


# ---------------------------------------------------------------------- time
def test_endless_loop_ends_at_the_wall_clock_time_out():
    result, elapsed = run("while True:\n    pass", timeout_s=1.0)
    assert result.status == "timeout" and result.limit_hit == "wall-clock time-out of 1 s"
    assert elapsed < 1.0 + MARGIN_S
    assert "wall-clock time-out" in result.as_tool_text()


def test_sleep_past_the_time_out_is_killed_and_a_short_one_is_not():
    result, elapsed = run("import time\ntime.sleep(60)\nprint('woke')", timeout_s=1.0)
    assert result.status == "timeout" and "woke" not in result.stdout
    assert elapsed < 1.0 + MARGIN_S
    control, _ = run("import time\ntime.sleep(0.2)\nprint('woke')", timeout_s=5.0)
    assert control.status == "ok" and control.stdout == "woke\n"


BUSY_1_5_S = "import time\nwhile time.process_time() < 1.5:\n    pass\nprint('done')"


def test_cpu_seconds_limit_ends_a_busy_loop_before_the_wall_clock():
    result, elapsed = run(BUSY_1_5_S, timeout_s=20.0, cpu_s=1)
    assert result.status == "cpu" and result.limit_hit == "CPU time limit of 1 s"
    assert elapsed < 20.0 and "done" not in result.stdout
    control, _ = run(BUSY_1_5_S, timeout_s=20.0, cpu_s=5)
    assert control.status == "ok" and control.stdout == "done\n"


# ---------------------------------------------------------------------- memory
def test_allocating_far_more_than_allowed_is_a_memory_error():
    code = "block = bytearray(512 << 20)\nprint('allocated', len(block) >> 20)"
    result, elapsed = run(code, memory_mb=128, timeout_s=5.0)
    assert result.status == "memory" and result.limit_hit == "memory limit of 128 MB"
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout
    assert elapsed < 5.0 + MARGIN_S
    # control: with room for it, the same allocation (calloc'd pages, never touched: cheap) succeeds
    control, _ = run(code, memory_mb=1024, timeout_s=5.0)
    assert control.status == "ok" and control.stdout == "allocated 512\n"


# ---------------------------------------------------------------------- processes
FORK_BOMB = "import os\nwhile True:\n    os.fork()"
FORK_TWELVE = """
import os, time
children = []
for _ in range(12):
    pid = os.fork()
    if pid == 0:
        time.sleep(0.3)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
print('forked', len(children))
"""


def test_fork_bomb_is_contained_by_the_process_limit():
    needs_own_uid()
    result, elapsed = run(FORK_BOMB, max_processes=8, timeout_s=3.0)
    assert result.status in ("processes", "timeout"), result
    assert result.limit_hit
    assert elapsed < 3.0 + MARGIN_S


def test_process_limit_stops_the_thirteenth_child_and_a_larger_limit_allows_it():
    needs_own_uid()
    result, _ = run(FORK_TWELVE, max_processes=8, timeout_s=5.0)
    assert result.status == "processes" and result.limit_hit == "process limit of 8"
    control, _ = run(FORK_TWELVE, max_processes=64, timeout_s=5.0)
    assert control.status == "ok" and control.stdout == "forked 12\n"


# ---------------------------------------------------------------------- files
def write_megabytes(count: int) -> str:
    return (f"with open('big.bin', 'wb') as big:\n    for _ in range({count}):\n        big.write(bytes(1 << 20))\n"
            f"print('wrote', {count})")


def test_a_one_gigabyte_file_stops_at_the_file_size_limit():
    result, elapsed = run(write_megabytes(1024), max_file_mb=16, timeout_s=10.0)
    assert result.status == "file_size" and result.limit_hit == "file size limit of 16 MB"
    assert "File too large" in result.stderr
    assert elapsed < 10.0 + MARGIN_S
    control, _ = run(write_megabytes(32), max_file_mb=64, timeout_s=10.0)
    assert control.status == "ok" and control.stdout == "wrote 32\n"


def test_writing_outside_the_folder_fails_and_leaves_the_target_unchanged():
    needs_namespaces()
    target = os.path.join(tempfile.gettempdir(), f"sandbox-escape-{uuid.uuid4().hex}.txt")  # /tmp: anyone writes
    code = f"open({target!r}, 'w').write('escaped')\nprint('wrote')"
    try:
        result, _ = run(code, timeout_s=5.0)
        assert result.status == "error" and "read-only outside the working folder" in result.limit_hit
        assert "wrote" not in result.stdout and not os.path.exists(target)
        # control: without the sandbox the same write lands
        control = plain_run(code)
        assert control.stdout == "wrote\n" and open(target).read() == "escaped"
    finally:
        subprocess.run(["rm", "-f", target], check=False)


# ---------------------------------------------------------------------- output
def test_printing_100_megabytes_is_stopped_at_the_output_cap():
    code = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\nprint('end')"
    result, elapsed = run(code, max_output_bytes=1 << 20, max_output_chars=1000, timeout_s=10.0)
    assert result.status == "output" and "output limit of 1048576 bytes" in result.limit_hit, result
    assert result.stdout == "x" * 1000 and result.truncated
    assert elapsed < 10.0 + MARGIN_S


def test_output_below_the_cap_is_kept_to_max_output_chars_and_the_run_completes():
    code = "import sys\nsys.stdout.write('é' * (2 << 20))\nprint('end')"  # 4 MB of UTF-8
    result, _ = run(code, max_output_bytes=8 << 20, max_output_chars=50, timeout_s=10.0)
    assert result.status == "ok" and result.stdout == "é" * 50 and result.truncated, result
    assert "(output truncated)" in result.as_tool_text()


# ---------------------------------------------------------------------- network
@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    yield server
    server.close()


def connect_code(port: int) -> str:
    return f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).close()\nprint('connected')"


def accepted(server: socket.socket) -> bool:
    try:
        connection, _ = server.accept()
    except socket.timeout:
        return False
    connection.close()
    return True


def test_network_connection_to_a_local_listener_fails(listener):
    needs_namespaces()
    result, _ = run(connect_code(listener.getsockname()[1]), timeout_s=5.0)
    assert result.status == "error" and result.limit_hit == "no network in the sandbox"
    assert "connected" not in result.stdout and not accepted(listener)


def test_network_connection_succeeds_once_the_network_is_allowed(listener):
    control, _ = run(connect_code(listener.getsockname()[1]), timeout_s=5.0, network=True)
    assert control.status == "ok" and control.stdout == "connected\n" and accepted(listener)


# ---------------------------------------------------------------------- environment
READ_SECRETS = """
import os
print(sorted(os.environ.items()))
for pid in (1, {parent}):
    try:
        print(open(f'/proc/{{pid}}/environ').read())
    except OSError as error:
        print('blocked', pid, type(error).__name__)
"""


def test_the_training_process_environment_is_not_visible(monkeypatch):
    needs_namespaces()
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", secret)
    code = READ_SECRETS.format(parent=os.getpid())
    result, _ = run(code, timeout_s=5.0)
    assert result.status == "ok"
    assert secret not in result.stdout + result.stderr
    assert "POSTTRAIN_TEST_SECRET" not in result.stdout
    # control: the same code in a plain child that inherits the environment finds the secret
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert secret in plain.stdout


# ---------------------------------------------------------------------- processes left behind
def leave_children(marker: str) -> str:
    sleeper = f"[sys.executable, '-c', 'import time; time.sleep(100)', {marker!r}]"
    return f"""
import os, subprocess, sys
subprocess.Popen({sleeper})
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, {sleeper})
    os._exit(0)
print('parent done')
"""


def test_background_children_and_a_setsid_double_fork_do_not_outlive_the_call():
    marker = f"sandbox-orphan-{uuid.uuid4().hex}"
    result, _ = run(leave_children(marker), marker=marker, timeout_s=5.0)  # Leftovers checks the marker
    assert result.status == "ok" and result.stdout == "parent done\n"
    assert "were killed" in result.limit_hit


def test_background_children_outlive_a_plain_child_process():
    marker = f"sandbox-orphan-{uuid.uuid4().hex}"
    subprocess.run([sys.executable, "-c", leave_children(marker)], timeout=30, start_new_session=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # pipes would stay open with the orphans
    deadline = time.monotonic() + 5
    while not processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = processes_with(marker)
    kill_all(left)
    assert left, "the control expected the plain child's background processes to survive"


def test_a_run_does_not_outlive_a_killed_training_process():
    needs_own_uid()  # the run is found by its uid
    parent_code = ("from posttrain.sandbox import Limits, LocalSandbox\n"
                   "sandbox = LocalSandbox(Limits(timeout_s=60))\n"  # after the start-up probe's own run
                   "print('ready', flush=True)\n"
                   "sandbox.run('import time\\ntime.sleep(60)')")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline() == "ready\n"
        deadline = time.monotonic() + 30
        while len(processes_with("", parent.pid)) < 3 and time.monotonic() < deadline:  # unshare, runner, code
            time.sleep(0.05)
        assert len(processes_with("", parent.pid)) == 3, "the sandboxed run never started"
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    deadline = time.monotonic() + MARGIN_S
    while processes_with("", parent.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = processes_with("", parent.pid)
    kill_all(left)
    assert not left, "the sandboxed code outlived the process that started it"
