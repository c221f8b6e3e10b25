"""Issue 59's walls: the sandbox starts on a venv and interpreter in private homes and shows exactly the
needed paths; host temp folders, path sockets and System V IPC are out of reach; ``memory_mb`` bounds the
whole run; the code in a user namespace has no capabilities. Each wall has a negative control: the same
code without the sandbox (`plain_run`, as root here) gets through."""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path
from unittest import mock

import pytest
from sandbox_checks import Leftovers, needs_namespaces, needs_own_uid, plain_run

import posttrain.sandbox.local as local
from posttrain.sandbox import Limits, LocalSandbox

REPO = Path(__file__).resolve().parents[2]


def run(code: str, num_workers: int = 1, **limits):
    sandbox = LocalSandbox(Limits(**limits), num_workers=num_workers)
    with Leftovers():
        return sandbox.run(code)


@pytest.fixture
def beside_the_interpreter():
    """A folder in the home that holds this interpreter (issue 59's layout: pyenv in /root, mode 700, and a
    venv in /root/.cache), others may enter (mode 755, as ~/.cache often is), with a token and the built-in
    task's held-out answers beside the venv; removed after."""
    home = Path.home()
    if not os.path.realpath(sys.base_prefix).startswith(str(home) + "/") or home.stat().st_mode & 0o001:
        pytest.fail(f"this check needs an interpreter in a private home (as /root/.pyenv); {sys.base_prefix}")
    folder = Path(tempfile.mkdtemp(prefix=".posttrain-test-", dir=home))
    folder.chmod(0o755)
    (folder / "posttrain" / "arithmetic" / "2digit").mkdir(parents=True)
    (folder / "hf_token").write_text("hf_secret")
    (folder / "posttrain" / "arithmetic" / "2digit" / "test.parquet").write_text("held-out answers")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


PEEK = textwrap.dedent("""
    import os
    cache = {cache!r}
    for path in (cache + "/hf_token", cache + "/posttrain/arithmetic/2digit/test.parquet"):
        try:
            print(open(path).read())
        except OSError as error:
            print(type(error).__name__)
    print(sorted(os.listdir(cache)) if os.path.isdir(cache) else "no cache")
    print("ran")
""")


# ---------------------------------------------------------------------- layout: venv and interpreter in private homes
def test_a_venv_beside_the_interpreter_in_a_private_home_runs_and_shows_only_what_it_needs(beside_the_interpreter):
    """Two needed paths under one private home (/root/.pyenv and the venv): the sandbox refused to start
    before, and showed the whole first-level folder on the way; now it starts and shows only the venv."""
    needs_namespaces()
    venv = beside_the_interpreter / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    peek = PEEK.format(cache=str(beside_the_interpreter))
    script = textwrap.dedent(f"""
        from posttrain.sandbox import Limits, LocalSandbox, isolation_available
        print(isolation_available()["namespaces"])
        result = LocalSandbox(Limits(timeout_s=10.0), num_workers=1).run({peek!r})
        print(result.status, result.limit_hit)
        print(result.stdout, end="")
    """)
    out = subprocess.run([str(venv / "bin" / "python"), "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    lines = out.stdout.splitlines()
    assert lines[:2] == ["None", "ok None"], out.stdout + out.stderr  # the probe passes; the run is ok
    assert lines[2:] == ["FileNotFoundError", "FileNotFoundError", "['venv']", "ran"]  # only the venv shows
    # control: without the sandbox the same code reads both files
    control = plain_run(peek)
    assert control.stdout.splitlines() == ["hf_secret", "held-out answers", "['hf_token', 'posttrain', 'venv']", "ran"]


def test_the_code_sees_no_host_temp_folder_no_project_and_of_the_home_only_the_way_to_the_interpreter():
    needs_namespaces()
    checkpoint = Path(tempfile.gettempdir(), f"posttrain-checkpoint-{uuid.uuid4().hex}.pt")
    checkpoint.write_text("weights")
    checkpoint.chmod(0o644)  # world-readable, as a checkpoint in the temp folder often is
    home = str(Path.home())
    code = textwrap.dedent(f"""
        import os
        print(os.path.exists({str(checkpoint)!r}), os.path.exists({str(REPO)!r}))
        print(sorted(os.listdir({home!r})) if os.path.isdir({home!r}) else [])
    """)
    try:
        result = run(code, timeout_s=10.0)
        first, listing = result.stdout.splitlines()
        assert first == "False False", result
        on_the_way = {Path(p).relative_to(home).parts[0] for p in local._interpreter_paths() if p.startswith(home + "/")}
        assert set(eval(listing)) == on_the_way, result  # /root here: .pyenv only
        control = plain_run(code)
        assert control.stdout.splitlines()[0] == "True True" and set(eval(control.stdout.splitlines()[1])) > on_the_way
    finally:
        checkpoint.unlink()


# ---------------------------------------------------------------------- host sockets and IPC
@pytest.fixture
def path_socket():
    """A world-writable unix socket listening on the host file system (as X11's or D-Bus's)."""
    folder = tempfile.mkdtemp(prefix="posttrain-sock-")
    os.chmod(folder, 0o777)
    path = os.path.join(folder, "agent.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(8)
    yield path
    server.close()
    shutil.rmtree(folder, ignore_errors=True)


CONNECT_UNIX = textwrap.dedent("""
    import socket
    client = socket.socket(socket.AF_UNIX)
    try:
        client.connect({address!r})
        print("connected")
    except OSError as error:
        print(type(error).__name__)
""")


@pytest.mark.parametrize("network", [False, True])
def test_a_world_writable_path_socket_on_the_host_does_not_answer(path_socket, network):
    needs_namespaces()
    result = run(CONNECT_UNIX.format(address=path_socket), timeout_s=10.0, network=network)
    assert result.stdout == "FileNotFoundError\n", result  # not there at all, network or not
    assert plain_run(CONNECT_UNIX.format(address=path_socket)).stdout == "connected\n"  # control


def test_an_abstract_socket_answers_only_with_network_allowed():
    needs_namespaces()
    name = f"\0posttrain-{uuid.uuid4().hex}"
    server = socket.socket(socket.AF_UNIX)
    server.bind(name)
    server.listen(8)
    try:
        assert run(CONNECT_UNIX.format(address=name), timeout_s=10.0).stdout == "ConnectionRefusedError\n"
        # control (and what --network means, said in its line): the host's network namespace reaches it
        assert run(CONNECT_UNIX.format(address=name), timeout_s=10.0, network=True).stdout == "connected\n"
    finally:
        server.close()


LIBC = ctypes.CDLL(None, use_errno=True)
IPC_CREAT, IPC_RMID = 0o1000, 0
LIBC.shmat.restype = ctypes.c_void_p
LIBC.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]

SHM_CODE = textwrap.dedent("""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    host = libc.shmget({key}, 0, 0)
    if host >= 0:
        address = libc.shmat(host, None, 0)
        print("read", ctypes.string_at(address, 11).decode())
        ctypes.memmove(address, b"overwritten", 11)
    else:
        print("no host segment", ctypes.get_errno())
    big = libc.shmget({big_key}, 200 << 20, 0o1600)
    print("made", big >= 0)
""")


def test_host_system_v_shared_memory_is_out_of_reach_and_a_segment_made_inside_dies_with_the_run():
    needs_namespaces()
    key, big_key = 0x5059_0000 + os.getpid() % 0xFFFF, 0x5159_0000 + os.getpid() % 0xFFFF
    segment = LIBC.shmget(key, 4096, IPC_CREAT | 0o666)
    assert segment >= 0, os.strerror(ctypes.get_errno())
    address = LIBC.shmat(segment, None, 0)
    ctypes.memmove(address, b"host secret", 11)
    try:
        result = run(SHM_CODE.format(key=key, big_key=big_key), timeout_s=10.0)
        assert result.stdout == "no host segment 2\nmade True\n", result  # ENOENT: another IPC namespace
        assert ctypes.string_at(address, 11) == b"host secret"
        assert LIBC.shmget(big_key, 0, 0) == -1  # the 200 MB segment went with the run's namespace
        # control: without the sandbox the code reads and overwrites the host's segment, and its own outlives it
        control = plain_run(SHM_CODE.format(key=key, big_key=big_key))
        assert control.stdout == "read host secret\nmade True\n" and ctypes.string_at(address, 11) == b"overwritten"
        leftover = LIBC.shmget(big_key, 0, 0)
        assert leftover >= 0
        LIBC.shmctl(leftover, IPC_RMID, None)
    finally:
        LIBC.shmdt(ctypes.c_void_p(address))
        LIBC.shmctl(segment, IPC_RMID, None)


# ---------------------------------------------------------------------- memory: the whole run
FOUR_CHILDREN_300_MB = textwrap.dedent("""
    import os
    children = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            block = b"x" * (300 << 20)  # written, so resident
            import time; time.sleep(1.5)
            os._exit(0)
        children.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    print("children", codes)
""")


def test_memory_mb_bounds_the_whole_run_not_each_process():
    needs_namespaces()
    if local.memory_cgroups()[0] is None:
        pytest.fail(f"no memory cgroup here ({local.memory_cgroups()[2]}); the per-process fallback is tested below")
    result = run(FOUR_CHILDREN_300_MB, timeout_s=20.0, memory_mb=512)  # each child is under 512 MB, all four are not
    assert result.status == "memory" and "for the whole run" in result.limit_hit, result
    assert "children [0, 0, 0, 0]" not in result.stdout
    control = run(FOUR_CHILDREN_300_MB, timeout_s=20.0, memory_mb=2048)
    assert control.status == "ok" and control.stdout == "children [0, 0, 0, 0]\n", control


def test_without_a_cgroup_the_line_says_per_process_and_the_process_count_is_cut():
    needs_own_uid()
    threads = ("import threading, time\nts = [threading.Thread(target=time.sleep, args=(0.3,)) for _ in range(12)]\n"
               "[t.start() for t in ts]\n[t.join() for t in ts]\nprint('threads', len(ts))")
    total_mb = local._total_memory_mb()
    memory_mb = max(32, total_mb // 2 // 4)  # half the machine, one run: a cut to 4 processes
    with mock.patch.object(local, "memory_cgroups", return_value=(None, 0, "cgroups are off (simulated)")):
        sandbox = LocalSandbox(Limits(timeout_s=10.0, memory_mb=memory_mb), num_workers=1)
        assert f"memory {memory_mb} MB per process, not per run (RLIMIT_AS; no cgroup: cgroups are off (simulated))" \
               f", so max_processes is cut to 4" in sandbox.isolation
        with Leftovers():
            cut = sandbox.run(threads)
    assert cut.status == "processes" and "threads" not in cut.stdout, cut
    control = run(threads, timeout_s=10.0, memory_mb=memory_mb)  # with the cgroup: no cut
    assert control.stdout == "threads 12\n", control


# ---------------------------------------------------------------------- user namespace: no capabilities
REMOUNT = textwrap.dedent("""
    import ctypes, os
    print(open("/proc/self/status").read().split("CapEff:")[1].split()[0])
    libc = ctypes.CDLL(None, use_errno=True)
    MS_REMOUNT, MS_BIND = 32, 4096
    ok = libc.mount(None, b"/usr", None, MS_REMOUNT | MS_BIND, None) == 0
    print("remounted writable" if ok else f"remount refused {ctypes.get_errno()}")
""")


def test_the_code_in_a_user_namespace_has_no_capabilities():
    needs_namespaces()
    with mock.patch.object(local, "_is_root", return_value=False):  # unshare --map-root-user, as a user gets
        sandbox = LocalSandbox(Limits(timeout_s=10.0), num_workers=1)
        with Leftovers():
            result = sandbox.run(REMOUNT)
    assert result.stdout == "0000000000000000\nremount refused 1\n", result  # EPERM
    # control: root of a user namespace has every capability there and may remount its binds writable
    control = subprocess.run(["unshare", "--map-root-user", "--mount", "--", sys.executable, "-I", "-c",
                              REMOUNT.replace('b"/usr"', 'b"/"')], capture_output=True, text=True, timeout=30)
    assert control.stdout.splitlines()[0] != "0000000000000000", control.stdout + control.stderr


# ---------------------------------------------------------------------- not root: a real user
NOT_ROOT_UID = 59059


def test_as_a_real_user_with_a_venv_in_a_private_home_the_sandbox_runs_in_a_user_namespace():
    """The sandbox package (it imports only posttrain.errors) copied into a private home of a uid with no
    account, a venv beside it made from the system's interpreter, all run as that uid."""
    needs_namespaces()
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or system_python is None:
        pytest.skip("needs root (to become another uid) and an interpreter every user can run (/usr/bin/python3)")
    base = Path(tempfile.mkdtemp(prefix="posttrain-user-"))
    home, package = base / "home", base / "home" / "lib" / "posttrain"
    try:
        (package / "sandbox").mkdir(parents=True)
        (home / ".cache").mkdir()
        (package / "__init__.py").write_text("")
        shutil.copy(REPO / "posttrain" / "errors.py", package)
        for source in (REPO / "posttrain" / "sandbox").glob("*.py"):
            shutil.copy(source, package / "sandbox")
        (home / ".cache" / "hf_token").write_text("hf_secret")
        for path in [base, *base.rglob("*")]:
            os.chown(path, NOT_ROOT_UID, NOT_ROOT_UID)
        base.chmod(0o711)
        home.chmod(0o700)
        as_user = {"user": NOT_ROOT_UID, "group": NOT_ROOT_UID, "extra_groups": [], "cwd": home, "timeout": 120,
                   "capture_output": True, "text": True,
                   "env": {"HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(home / "lib")}}
        venv = home / ".cache" / "venv"
        subprocess.run([system_python, "-m", "venv", "--without-pip", str(venv)], check=True, **as_user)
        script = textwrap.dedent(f"""
            from posttrain.sandbox import Limits, LocalSandbox, isolation_available
            print(isolation_available()["namespaces"])
            sandbox = LocalSandbox(Limits(timeout_s=10.0), num_workers=1)
            print(sandbox.isolation)
            result = sandbox.run({PEEK.format(cache=str(home / ".cache"))!r} + {REMOUNT!r})
            print(result.status, result.limit_hit)
            print(result.stdout, end="")
        """)
        out = subprocess.run([str(venv / "bin" / "python"), "-c", script], **as_user)
        lines = out.stdout.splitlines()
        assert lines[0] == "None", out.stdout + out.stderr
        assert lines[1].startswith("namespaces (unshare: pid, mount, ipc, net, user; no network;")
        assert lines[2:] == ["ok None", "FileNotFoundError", "FileNotFoundError", "['venv']", "ran",
                             "0000000000000000", "remount refused 1"], out.stdout + out.stderr
        control = subprocess.run([str(venv / "bin" / "python"), "-c", PEEK.format(cache=str(home / ".cache"))],
                                 **as_user)  # control: the same uid without the sandbox reads its token
        assert control.stdout.splitlines()[0] == "hf_secret"
    finally:
        shutil.rmtree(base, ignore_errors=True)
