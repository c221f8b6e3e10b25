"""The local sandbox: each run is a fresh process tree in a temporary folder, limited and isolated.

Per run (`LocalSandbox.run`): a temporary folder (deleted after) holding ``main.py``; a child started with
an environment of only PATH, HOME (the folder) and LANG; Python in isolated mode (``-I``; ``-S`` with the
interpreter's site-packages added by path, so numpy imports but no ``.pth`` hook runs, which also saves
~40 ms a call); `posttrain.sandbox.runner` inside it applies the limits and the time-out. Its stdout and
stderr are read as they come, keeping only the head; past ``max_output_bytes`` in all the run is stopped.

Isolation is chosen once per process (`isolation_available`) and is one of:

- ``namespaces``: util-linux ``unshare`` puts the run in new pid, mount, IPC and (``network=False``) network
  namespaces, on a new root file system holding only the system folders, the interpreter's paths and its
  site-packages (read-only), a minimal /dev, a fresh /proc, and the folder and /dev/shm, each a size-capped
  tmpfs of the run's own (``max_folder_mb``); no home, host temp folder, /run (path sockets) or host IPC;
  ending the namespace's pid 1 kills every process the code started. As root the code runs under a uid of its
  own per run in flight, so RLIMIT_NPROC holds and files owned by root are not writable. Without root it
  needs unprivileged user namespaces (``--map-root-user``); the code then has no capability left.
- ``none``: resource limits, scrubbed environment, own session and the sweep only; the code can use the
  network, write where its uid may, and (as the same uid) read other processes' /proc entries. As root it is
  refused where other uids cannot reach the interpreter (the code would run as root).

Either way ``memory_mb`` bounds the whole run in a memory cgroup of its own (`posttrain.sandbox.cgroup`)
where one can be made; elsewhere it is per process and ``max_processes`` is cut to fit (`_process_cap`).
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import logging
import os
import py_compile
import queue
import select
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import weakref
from functools import lru_cache
from pathlib import Path

from posttrain.errors import ConfigError
from posttrain.sandbox.cgroup import RunCgroup, memory_cgroups
from posttrain.sandbox.limits import Limits, RunResult

__all__ = ["LANGUAGES", "LocalSandbox", "isolation_available", "limits_words"]

logger = logging.getLogger(__name__)

LANGUAGES = ("python",)
RUNNER_PATH = Path(__file__).with_name("runner.py")
FIRST_UID = 1_000_000  # run uids start here: FIRST_UID + pid * 64 + slot, unused by any account
MAX_WORKERS = 64
# A run's uid comes from a slot no other run of this process holds, whichever LocalSandbox starts it: two
# runs sharing a uid would share RLIMIT_NPROC and could be killed by each other's sweep.
_SLOTS: queue.Queue[int] = queue.Queue()
for _slot in range(MAX_WORKERS):
    _SLOTS.put(_slot)
START_GRACE_S = 5.0  # parent's back-stop past the runner's own time-out: interpreter start, sweep, load
WEAKER_KEY = "isolation: none (tool YAML) or --isolation none (posttrain sandbox serve)"


def _is_root() -> bool:
    return os.geteuid() == 0


def _unshare_command(network: bool) -> list[str]:
    command = ["unshare", "--pid", "--mount", "--ipc", "--fork", "--kill-child", "--propagation", "private"]
    if not network:
        command.append("--net")
    if not _is_root():
        command.append("--map-root-user")
    return command + ["--"]


@lru_cache(maxsize=None)
def isolation_available() -> dict[str, str | None]:
    """What this machine allows, probed once per process: ``{"namespaces": None or why not, "bwrap": ...,
    "firejail": ...}`` (None = works). Namespaces are tried for real: a run must start, see no network
    and be unable to write outside its folder."""
    found = {"namespaces": None, "bwrap": "isolation 'bwrap' is not implemented (namespaces via unshare are)",
             "firejail": "isolation 'firejail' is not implemented (namespaces via unshare are)"}
    if not sys.platform.startswith("linux"):
        found["namespaces"] = "Linux namespaces need Linux"
    elif shutil.which("unshare") is None:
        found["namespaces"] = "util-linux `unshare` is not installed"
    else:
        found["namespaces"] = _probe_namespaces()
    return found


PROBE_CODE = """
import socket, sys
s = socket.socket(); s.settimeout(1)
try:
    s.connect(("127.0.0.1", 9)); print("network")
except OSError:
    pass
for path in ("/posttrain-sandbox-probe", "/tmp/posttrain-sandbox-probe"):
    try:
        open(path, "w").close(); print("writable", path)
    except OSError:
        pass
print("probe ok")
"""


def _probe_namespaces() -> str | None:
    try:
        sandbox = LocalSandbox.__new__(LocalSandbox)
        sandbox._setup(Limits(timeout_s=10.0, isolation="none"), num_workers=1, mode="namespaces")
        result = sandbox.run(PROBE_CODE)
    except (OSError, subprocess.SubprocessError) as error:
        return f"unshare failed: {error}"
    if result.stdout.strip() != "probe ok":
        # the sandbox's own failure is in limit_hit ("sandbox error: ..."), the code's in stderr
        why = result.limit_hit if result.status == "sandbox_error" and result.limit_hit else (
            result.stderr.strip().splitlines() or [result.stdout.strip() or result.status])[-1]
        hint = "" if _is_root() else (" (not root: this needs unprivileged user namespaces, e.g. sysctl "
                                      "kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0)")
        return f"a probe run under unshare did not come out isolated: {why[:300]}{hint}"
    return None


class LocalSandbox:
    """Runs code in a fresh, limited, isolated process tree; at most ``num_workers`` at a time."""

    def __init__(self, limits: Limits = Limits(), *, num_workers: int = 4):
        if not 1 <= num_workers <= MAX_WORKERS:
            raise ConfigError(f"sandbox num_workers={num_workers}: valid 1 to {MAX_WORKERS}")
        self._setup(limits, num_workers, _choose_mode(limits))
        _announce(self.isolation)

    def _setup(self, limits: Limits, num_workers: int, mode: str) -> None:
        self.limits = limits
        self.num_workers = num_workers
        self.mode = mode
        self._workers = threading.BoundedSemaphore(num_workers)
        self._async_slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per event loop
        self._active: set[subprocess.Popen] = set()  # runs in flight, for `close`
        self._active_lock = threading.Condition()
        self._in_flight = 0
        self.closed = False
        self.isolation = _describe(mode, limits, num_workers)

    # ------------------------------------------------------------------ public
    def run(self, code: str, language: str = "python", stdin: str = "", limits: Limits | None = None) -> RunResult:
        """Run ``code`` and wait for it; blocks while all ``num_workers`` are busy. ``limits`` may tighten
        or change this sandbox's for one call, never its isolation."""
        if self.closed:
            return RunResult("sandbox_error", "", "", None, 0.0, limit_hit="sandbox error: the sandbox is closed")
        if language not in LANGUAGES:
            return RunResult("sandbox_error", "", f"unknown language {language!r}; this sandbox runs: "
                             f"{', '.join(LANGUAGES)}", None, 0.0, limit_hit=None)
        limits = self.limits if limits is None else limits.replace(isolation=self.limits.isolation,
                                                                   network=self.limits.network)
        with self._workers:
            slot = _SLOTS.get()
            with self._active_lock:
                self._in_flight += 1
            try:
                return _Run(self, slot, limits).execute(code, stdin)
            except OSError as error:  # no temporary folder, no process: the sandbox failed, not the code
                return RunResult("sandbox_error", "", "", None, 0.0, limit_hit=f"sandbox error: {error}")
            finally:
                _SLOTS.put(slot)
                with self._active_lock:
                    self._in_flight -= 1
                    self._active_lock.notify_all()

    async def run_async(self, code: str, language: str = "python", stdin: str = "",
                        limits: Limits | None = None) -> RunResult:
        """`run` in a thread, at most ``num_workers`` at a time."""
        loop = asyncio.get_running_loop()
        slots = self._async_slots.setdefault(loop, asyncio.Semaphore(self.num_workers))
        async with slots:
            return await asyncio.to_thread(self.run, code, language, stdin, limits)

    def close(self, timeout_s: float = 2 * START_GRACE_S) -> None:
        """Stop the runs in flight and wait until each has cleaned up (processes, folder); for a server
        that shuts down."""
        with self._active_lock:
            self.closed = True
            for child in self._active:
                _Run.stop(child, self.mode)
            self._active_lock.wait_for(lambda: self._in_flight == 0, timeout=timeout_s)

    def uid_for(self, slot: int) -> int | None:
        """The uid the code of a run holding ``slot`` runs as: one of its own when we are root (so
        RLIMIT_NPROC counts only that run and files owned by root stay unwritable), else ours."""
        if not _is_root():
            return None
        return FIRST_UID + (os.getpid() % (1 << 22)) * MAX_WORKERS + slot


def _choose_mode(limits: Limits) -> str:
    wanted = limits.isolation
    if wanted == "none":  # the explicit choice of weaker isolation: network and file system stay open
        if _is_root() and not _reachable_by_others(_interpreter_paths()):
            raise ConfigError(
                f"sandbox isolation 'none' as root: the code would run as root, because other uids cannot reach "
                f"this interpreter ({_first_private(_interpreter_paths())} may not be entered by others); use "
                f"isolation: auto (namespaces), or run as a user other than root, or use an interpreter every "
                f"user can read")
        return "none"
    available = isolation_available()
    if wanted == "bwrap":
        raise ConfigError(f"isolation: {wanted} is not available: {available[wanted]}; accept weaker isolation "
                          f"with {WEAKER_KEY}, or use isolation: namespaces")
    why_not = available["namespaces"]
    if why_not is not None:
        raise ConfigError(f"sandbox isolation {wanted!r} needs Linux namespaces, which this machine does not allow "
                          f"({why_not}); to run model code without network and file-system isolation set "
                          f"{WEAKER_KEY}")
    return "namespaces"


def _describe(mode: str, limits: Limits, num_workers: int) -> str:
    """One line: the isolation active and, where it is weaker than root's namespaces, what does not hold."""
    memory = _memory_words(limits, num_workers)
    if mode == "none":
        uid = "own uid per run" if _is_root() else "your uid"
        return (f"none (holds: resource limits, {memory}, wall-clock time-out, scrubbed environment, process sweep, "
                f"{uid}; NOT isolated: network, file system (readable and writable wherever this uid may), IPC, "
                "other processes' /proc)")
    spaces = "pid, mount, ipc" + ("" if limits.network else ", net") + ("" if _is_root() else ", user")
    uid = "own uid per run" if _is_root() else (
        "user namespace: the code runs as your uid without capabilities, so max_processes counts all your "
        "processes and threads")
    net = ("network open: every port of this machine's localhost and its abstract sockets too" if limits.network
           else "no network")
    return (f"namespaces (unshare: {spaces}; {net}; {memory}; file system: only the system folders, the interpreter "
            f"and its site-packages, read-only, and the run's own folder and /dev/shm; {uid})")


def limits_words(limits: Limits, num_workers: int) -> str:
    """Every limit a run gets, as applied (without a memory cgroup, max_processes as cut to fit: `_process_cap`)."""
    cgroup = memory_cgroups()[0] is not None
    processes = limits.max_processes if cgroup else _process_cap(limits, num_workers)
    return (f"wall-clock time-out {limits.timeout_s:g} s, CPU {limits.cpu_seconds} s, memory {limits.memory_mb} MB "
            f"{'for the whole run' if cgroup else 'per process'}, {processes} processes and threads, "
            f"{limits.max_file_mb} MB per file, {limits.max_folder_mb} MB working folder, {limits.max_open_files} open "
            f"files, output {limits.max_output_chars} characters per stream ({limits.max_output_bytes} bytes in all), "
            f"network {'open' if limits.network else 'off'}")


def _memory_words(limits: Limits, num_workers: int) -> str:
    folder, _, why_not = memory_cgroups()
    if folder is not None:
        return f"memory {limits.memory_mb} MB for the whole run (cgroup)"
    cap = _process_cap(limits, num_workers)
    return (f"memory {limits.memory_mb} MB per process, not per run (RLIMIT_AS; no cgroup: {why_not}), so "
            f"max_processes is cut to {cap}: a run holds at most {cap * limits.memory_mb} MB")


@lru_cache(maxsize=None)
def _total_memory_mb() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) >> 10
    except (OSError, ValueError):
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20


def _process_cap(limits: Limits, num_workers: int) -> int:
    """Without a cgroup: processes a run may have (threads count too) so that ``num_workers`` runs of
    ``memory_mb`` each per process fit in half of this machine's memory; at least 1, at most max_processes."""
    budget_mb = _total_memory_mb() // 2 // max(1, num_workers)
    return max(1, min(limits.max_processes, budget_mb // limits.memory_mb))


@lru_cache(maxsize=None)
def _announce(isolation: str) -> None:
    """Say once per process which isolation runs model code, loudly when it is not namespaces."""
    if isolation.startswith("none"):
        logger.warning("sandbox isolation: %s", isolation)
    else:
        logger.info("sandbox isolation: %s", isolation)


@lru_cache(maxsize=None)
def _runner_program() -> tuple[str, ...]:
    """The runner as the interpreter's argument: its compiled file (compiling the source costs 3-6 ms of
    every call), compiled once per process; else its source with -c (a read-only installation)."""
    compiled = importlib.util.cache_from_source(str(RUNNER_PATH))
    try:
        return (py_compile.compile(str(RUNNER_PATH), cfile=compiled, doraise=True),)
    except (OSError, py_compile.PyCompileError):
        return ("-c", RUNNER_PATH.read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def _interpreter_paths() -> tuple[str, ...]:
    paths = {os.path.realpath(sys.executable), os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}
    paths.update(os.path.realpath(p) for p in _site_dirs())
    return tuple(sorted(p for p in paths if os.path.exists(p)))


@lru_cache(maxsize=None)
def _site_dirs() -> tuple[str, ...]:
    dirs = [sysconfig.get_paths()[key] for key in ("purelib", "platlib")]
    return tuple(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


def _reachable_by_others(paths: tuple[str, ...]) -> bool:
    """Whether a uid of no account can enter every directory down to each of ``paths``."""
    for path in paths:
        parts = Path(path).parts
        for depth in range(1, len(parts)):
            directory = Path(*parts[:depth])
            if not os.stat(directory).st_mode & 0o001:
                return False
    return True


def _first_private(paths: tuple[str, ...]) -> str:
    """The first directory on the way to ``paths`` that others may not enter, with its mode."""
    for path in paths:
        parts = Path(path).parts
        for depth in range(1, len(parts)):
            directory = Path(*parts[:depth])
            mode = os.stat(directory).st_mode
            if not mode & 0o001:
                return f"{directory}, mode {mode & 0o7777:o},"
    return "a folder on the way"


def _tasks_of(uid: int) -> int:
    """Processes and threads running as ``uid`` (what RLIMIT_NPROC counts)."""
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{name}/task"))
            except OSError:
                pass
    return count


class _Run:
    """One call: folder, child, capped reading, classification, clean-up."""

    def __init__(self, sandbox: LocalSandbox, slot: int, limits: Limits):
        self.sandbox = sandbox
        self.limits = limits
        self.uid = sandbox.uid_for(slot)
        parent, version, _ = memory_cgroups()
        self.cgroup = RunCgroup(parent, version, f"posttrain-sandbox-{os.getpid()}-{slot}") if parent else None
        self.oom_kills = 0
        self.keep_bytes = limits.max_output_chars * 4 + 4  # a UTF-8 character is at most 4 bytes
        self.heads = {"stdout": bytearray(), "stderr": bytearray()}
        self.total_bytes = 0
        self.stopped_for: str | None = None

    def execute(self, code: str, stdin: str) -> RunResult:
        start = time.monotonic()
        folder = tempfile.mkdtemp(prefix=f"posttrain-sandbox-{os.getpid()}-")  # whose it is, in a listing
        try:
            Path(folder, "main.py").write_bytes(code.encode("utf-8", errors="replace"))  # lone surrogates: "?"
            if self.uid is not None:
                os.chown(folder, self.uid, self.uid)
            if self.cgroup is not None:
                self.cgroup.create(self.limits.memory_mb)
            try:
                report = self._spawn_and_collect(folder, stdin.encode("utf-8", errors="replace"))
            finally:
                if self.cgroup is not None:
                    self.oom_kills = self.cgroup.oom_kills()
                    self.cgroup.remove()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return self._result(report, time.monotonic() - start)

    def _config(self, folder: str, status_fd: int) -> str:
        limits = self.limits
        nproc = limits.max_processes if self.cgroup else _process_cap(limits, self.sandbox.num_workers)
        if self.uid is None:
            nproc += _tasks_of(os.getuid())
        return repr({
            "folder": folder, "status_fd": status_fd, "uid": self.uid, "timeout_s": limits.timeout_s,
            "mounts": self.sandbox.mode == "namespaces", "folder_mb": limits.max_folder_mb,
            "cgroup": self.cgroup.procs_file if self.cgroup else None,
            "reach": list(_interpreter_paths()), "site": [os.path.realpath(d) for d in _site_dirs()],
            "limits": {"memory_mb": limits.memory_mb, "cpu_s": limits.cpu_seconds, "nproc": nproc,
                       "max_file_mb": limits.max_file_mb, "max_open_files": limits.max_open_files}})

    def _command(self, folder: str, status_fd: int) -> list[str]:
        python = [sys.executable, "-I", "-S", *_runner_program(), self._config(folder, status_fd)]
        if self.sandbox.mode == "namespaces":
            return _unshare_command(self.limits.network) + python
        return python

    def _spawn_and_collect(self, folder: str, stdin: bytes) -> dict:
        status_read, status_write = os.pipe()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": folder, "LANG": "C.UTF-8"}
        try:
            child = subprocess.Popen(self._command(folder, status_write), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=folder,
                                     pass_fds=(status_write,), start_new_session=True)
        finally:
            os.close(status_write)
        with self.sandbox._active_lock:
            self.sandbox._active.add(child)
        try:
            self._feed_and_read(child, stdin)
        finally:
            self._end(child)
            with self.sandbox._active_lock:
                self.sandbox._active.discard(child)
            with os.fdopen(status_read, "rb") as status:
                line = status.read().decode("utf-8", errors="replace").strip()
        return ast.literal_eval(line) if line else {"error": "the sandbox runner ended without a report"}

    def _feed_and_read(self, child: subprocess.Popen, stdin: bytes) -> None:
        deadline = time.monotonic() + self.limits.timeout_s + START_GRACE_S
        with selectors.DefaultSelector() as selector:
            selector.register(child.stdout, selectors.EVENT_READ, "stdout")
            selector.register(child.stderr, selectors.EVENT_READ, "stderr")
            if stdin:
                os.set_blocking(child.stdin.fileno(), False)
                selector.register(child.stdin, selectors.EVENT_WRITE, "stdin")
            else:
                child.stdin.close()
            pending = memoryview(stdin)
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.stopped_for = "timeout"
                    return
                for key, _ in selector.select(remaining):
                    if key.data == "stdin":
                        pending = self._write_some(selector, key.fileobj, pending)
                    elif not self._read_some(selector, key.fileobj, key.data):
                        return

    def _write_some(self, selector, pipe, pending: memoryview) -> memoryview:
        try:
            pending = pending[os.write(pipe.fileno(), pending[:65536]):]
        except BrokenPipeError:
            pending = pending[:0]
        if not pending:
            selector.unregister(pipe)
            pipe.close()
        return pending

    def _read_some(self, selector, pipe, name: str) -> bool:
        """Read what is there; False once the output cap is passed (the run is then stopped)."""
        data = os.read(pipe.fileno(), 65536)
        if not data:
            selector.unregister(pipe)
            return True
        self.total_bytes += len(data)
        head = self.heads[name]
        if len(head) < self.keep_bytes:
            head += data[: self.keep_bytes - len(head)]
        if self.total_bytes > self.limits.max_output_bytes:
            self.stopped_for = "output"
            return False
        return True

    def _end(self, child: subprocess.Popen) -> None:
        """Return only once the run's whole tree is gone: ask the runner to stop (it kills the code and
        sweeps; in namespaces its exit ends the pid namespace before unshare can exit), else kill it."""
        runner = _runner_pid(child, self.sandbox.mode)
        if child.poll() is None and self.stopped_for:
            self.stop(child, self.sandbox.mode)
        try:
            child.wait(timeout=START_GRACE_S)
        except subprocess.TimeoutExpired:
            self._signal(child, signal.SIGKILL)  # unshare's death kills the runner (--kill-child)
            child.wait()
        _wait_gone(runner)  # a killed runner's namespace is torn down after unshare has gone
        self._signal(child, signal.SIGKILL)  # anything left in the runner's group (the code has its own session)
        for pipe in (child.stdin, child.stdout, child.stderr):
            if pipe and not pipe.closed:
                pipe.close()

    @staticmethod
    def stop(child: subprocess.Popen, mode: str) -> None:
        """Ask the runner to stop (SIGTERM: it kills the code's session and sweeps what is left)."""
        runner = _runner_pid(child, mode)
        if runner is None:
            _Run._signal(child, signal.SIGKILL)
            return
        try:
            os.kill(runner, signal.SIGTERM)
        except ProcessLookupError:
            pass

    @staticmethod
    def _signal(child: subprocess.Popen, signum: int) -> None:
        try:
            os.killpg(child.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    # ------------------------------------------------------------------ classification
    def _text(self, name: str) -> tuple[str, bool]:
        text = bytes(self.heads[name]).decode("utf-8", errors="replace")
        limit = self.limits.max_output_chars
        return text[:limit], len(text) > limit or len(self.heads[name]) >= self.keep_bytes

    def _result(self, report: dict, wall_s: float) -> RunResult:
        stdout, cut_out = self._text("stdout")
        stderr, cut_err = self._text("stderr")
        code = report.get("returncode")
        status, limit_hit = _classify(report, self.stopped_for, self.limits, stderr, self.oom_kills)
        if self.sandbox.closed and report.get("stopped"):
            status, limit_hit = "killed", "stopped: the sandbox was closed (its server shut down) while the code ran"
        return RunResult(status, stdout, stderr, code, round(wall_s, 4), limit_hit, cut_out or cut_err)


def _runner_pid(child: subprocess.Popen, mode: str) -> int | None:
    """The runner's pid: the child itself, or (namespaces) unshare's one child."""
    if mode == "none":
        return child.pid
    try:
        with open(f"/proc/{child.pid}/task/{child.pid}/children", encoding="ascii") as listing:
            pids = listing.read().split()
    except OSError:
        return None
    return int(pids[0]) if pids else None


def _wait_gone(pid: int | None, timeout_s: float = START_GRACE_S) -> None:
    if pid is None:
        return
    try:
        watcher = os.pidfd_open(pid)
    except OSError:  # already gone
        return
    try:
        select.select([watcher], [], [], timeout_s)
    finally:
        os.close(watcher)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _classify(report: dict, stopped_for: str | None, limits: Limits, stderr: str,
              oom_kills: int = 0) -> tuple[str, str | None]:
    """(status, limit in words) from the runner's report, why the parent stopped it, stderr's tail and the
    processes the run's memory cgroup killed."""
    if stopped_for == "output":
        return "output", f"output limit of {limits.max_output_bytes} bytes; the run was stopped"
    if report.get("timed_out") or stopped_for == "timeout":
        return "timeout", f"wall-clock time-out of {limits.timeout_s:g} s"
    if report.get("error"):
        said = stderr.strip().splitlines()[-1:] if "without a report" in report["error"] else []
        return "sandbox_error", f"sandbox error: {report['error']}" + "".join(f" ({line[:300]})" for line in said)
    code = report.get("returncode")
    tail = stderr[-2000:]
    swept = report.get("swept", 0)
    left = f"{swept} process(es) still running after the code ended were killed" if swept else None
    if code in (-signal.SIGXCPU,) or (code == -signal.SIGKILL and report.get("cpu_s", 0) >= limits.cpu_seconds):
        return "cpu", f"CPU time limit of {limits.cpu_seconds} s"
    if oom_kills:  # whichever process it was, the run went past its memory
        return "memory", f"memory limit of {limits.memory_mb} MB for the whole run ({oom_kills} process(es) killed)"
    if code == 0:
        return "ok", left
    if "MemoryError" in tail or "Cannot allocate memory" in tail:
        return "memory", f"memory limit of {limits.memory_mb} MB"
    if "File too large" in tail or code == -signal.SIGXFSZ:
        return "file_size", f"file size limit of {limits.max_file_mb} MB"
    if "Resource temporarily unavailable" in tail or "can't start new thread" in tail:
        return "processes", f"process limit of {limits.max_processes}"
    if code is not None and code < 0:
        return "killed", f"killed by signal {_signal_name(-code)}"
    if "Network is unreachable" in tail:
        return "error", "no network in the sandbox"
    if "Read-only file system" in tail:
        return "error", "the file system is read-only outside the working folder and /dev/shm"
    if "No space left on device" in tail:
        return "error", f"no space left: the working folder and /dev/shm hold at most {limits.max_folder_mb} MB each"
    if "Too many open files" in tail:
        return "error", f"open-file limit of {limits.max_open_files}"
    return "error", left
