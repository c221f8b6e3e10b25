"""The limits the sandbox claims beyond test_sandbox_hostile.py's cases: the run's own /dev/shm (writable,
capped, separate from the host's), the working folder's size cap, the open-file limit, no core dumps, and
/root hidden. Each has a negative control that shows the case succeeds without the limit."""

from __future__ import annotations

import os
import uuid

import pytest
from sandbox_checks import Leftovers, needs_namespaces, needs_own_uid, plain_run

from posttrain.sandbox import Limits, LocalSandbox


def run(code: str, **limits):
    sandbox = LocalSandbox(Limits(**limits), num_workers=1)
    with Leftovers():
        return sandbox.run(code)


def write_files(folder: str, count: int, megabytes: int) -> str:
    """Code that writes ``count`` files of ``megabytes`` MB each under ``folder``, each below the per-file limit."""
    return (f"import os\nfor i in range({count}):\n"
            f"    with open(os.path.join({folder!r}, f'part{{i}}.bin'), 'wb') as part:\n"
            f"        part.write(bytes({megabytes} << 20))\n"
            f"print('wrote', {count})")


# ---------------------------------------------------------------------- /dev/shm
SEMAPHORES = """
import multiprocessing as mp
lock = mp.Lock()
with lock:
    print('locked')
with mp.Pool(2) as pool:
    print(pool.map(abs, [-1, -2]))
"""


def test_multiprocessing_semaphores_work_in_the_runs_own_dev_shm():
    needs_namespaces()
    host_before = set(os.listdir("/dev/shm"))
    result = run(SEMAPHORES + "import os\nopen('/dev/shm/left-by-run', 'w').write('x')\nprint(os.listdir('/dev/shm'))",
                 timeout_s=20.0)
    assert result.status == "ok", result
    assert result.stdout.splitlines()[:2] == ["locked", "[1, 2]"]
    assert "left-by-run" in result.stdout.splitlines()[2]
    # the run's /dev/shm is its own: what it wrote is not in the host's, and the host's files were not listed
    assert "left-by-run" not in os.listdir("/dev/shm")
    assert set(os.listdir("/dev/shm")) - host_before == set()


def test_dev_shm_cannot_grow_past_the_cap():
    needs_namespaces()
    # three 3 MB files under a 8 MB cap: the third does not fit (each is below max_file_mb, so only the cap binds)
    result = run(write_files("/dev/shm", 3, 3), max_folder_mb=8, max_file_mb=4, timeout_s=10.0)
    assert result.status == "error" and "No space left on device" in result.stderr
    assert result.limit_hit == "no space left: the working folder and /dev/shm hold at most 8 MB each"
    assert "wrote" not in result.stdout
    control = run(write_files("/dev/shm", 3, 3), max_folder_mb=16, max_file_mb=4, timeout_s=10.0)
    assert control.status == "ok" and control.stdout == "wrote 3\n"


def test_a_host_file_in_dev_shm_is_neither_readable_nor_changed():
    needs_namespaces()
    name = f"posttrain-host-{uuid.uuid4().hex}"
    path = os.path.join("/dev/shm", name)
    with open(path, "w") as host_file:
        host_file.write("host secret")
    try:
        code = f"import os\nprint({name!r} in os.listdir('/dev/shm'))\nopen({path!r}, 'w').write('overwritten')"
        result = run(code, timeout_s=5.0)
        assert result.stdout.startswith("False\n")  # hidden; the write makes a file in the run's own tmpfs
        assert open(path).read() == "host secret"
        control = plain_run(code)
        assert control.stdout.startswith("True\n")
    finally:
        os.unlink(path)


# ---------------------------------------------------------------------- working folder
def test_the_working_folder_cannot_grow_past_its_cap():
    needs_namespaces()
    result = run(write_files(".", 3, 3), max_folder_mb=8, max_file_mb=4, timeout_s=10.0)
    assert result.status == "error" and "No space left on device" in result.stderr
    assert "at most 8 MB" in result.limit_hit and "wrote" not in result.stdout
    control = run(write_files(".", 3, 3), max_folder_mb=16, max_file_mb=4, timeout_s=10.0)
    assert control.status == "ok" and control.stdout == "wrote 3\n"


# ---------------------------------------------------------------------- open files
OPEN_40 = "handles = [open('main.py') for _ in range(40)]\nprint('opened', len(handles))"


def test_open_file_limit_stops_the_code_and_names_the_limit():
    result = run(OPEN_40, max_open_files=16, timeout_s=5.0)
    assert result.status == "error" and "Too many open files" in result.stderr
    assert result.limit_hit == "open-file limit of 16" and "opened" not in result.stdout
    assert "[sandbox: open-file limit of 16]" in result.as_tool_text()
    control = run(OPEN_40, max_open_files=64, timeout_s=5.0)
    assert control.status == "ok" and control.stdout == "opened 40\n"


# ---------------------------------------------------------------------- core dumps
def test_the_code_cannot_raise_its_core_dump_limit():
    code = ("import resource\nprint(resource.getrlimit(resource.RLIMIT_CORE))\n"
            "resource.setrlimit(resource.RLIMIT_CORE, (1 << 20, 1 << 20))")
    result = run(code, timeout_s=5.0)
    assert result.stdout == "(0, 0)\n" and result.status == "error" and "ValueError" in result.stderr


# ---------------------------------------------------------------------- /root
def test_files_under_root_are_hidden():
    needs_own_uid()  # /root is covered only where the run has a uid of its own
    if not (os.path.isdir("/root") and os.access("/root", os.W_OK)):
        pytest.skip("/root is not ours to write a probe file into")
    path = f"/root/posttrain-probe-{uuid.uuid4().hex}"
    with open(path, "w") as probe:
        probe.write("root secret")
    try:
        code = f"import os\nprint(os.path.exists({path!r}))\nprint(open({path!r}).read())"
        result = run(code, timeout_s=5.0)
        assert result.stdout == "False\n" and "root secret" not in result.stdout + result.stderr
        # control: without the sandbox, root's code reads the file
        control = plain_run(code)
        assert control.stdout == "True\nroot secret\n"
    finally:
        os.unlink(path)


# ---------------------------------------------------------------------- threads count as processes
THREADS_40 = """
import threading, time
threads = [threading.Thread(target=time.sleep, args=(0.5,)) for _ in range(40)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print('threads', len(threads))
"""


def test_threads_count_against_the_process_limit():
    needs_own_uid()
    result = run(THREADS_40, max_processes=8, timeout_s=10.0)
    assert result.status == "processes" and result.limit_hit == "process limit of 8"
    assert "can't start new thread" in result.stderr and "threads" not in result.stdout
    control = run(THREADS_40, max_processes=64, timeout_s=10.0)
    assert control.status == "ok" and control.stdout == "threads 40\n"


# ---------------------------------------------------------------------- isolated mode
def test_the_code_runs_in_pythons_isolated_mode():
    import subprocess
    import sys

    code = "import sys\nprint(sys.flags.isolated, sys.flags.ignore_environment, sys.flags.no_user_site)"
    assert run(code, timeout_s=5.0).stdout == "1 1 1\n"
    # control: a plain interpreter is not in isolated mode
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert plain.stdout == "0 0 0\n"
