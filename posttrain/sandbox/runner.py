"""The program that runs inside the sandbox, around the model's code.

`posttrain.sandbox.local` starts it as ``python -I -S <this file, compiled> <config>`` (under ``unshare``
when namespaces are on), so it imports nothing but the standard library and is never imported by the
training process. The config and the report are Python literals, not JSON: importing json (and re) would
cost ~10 ms of every call. It:

1. (namespaces) runs as root of fresh mount/pid/net namespaces: mounts a new /proc, a size-capped tmpfs
   as the working folder, remounts every other mount read-only, then mounts a fresh size-capped tmpfs of
   the run's own on /dev/shm (multiprocessing's semaphores live there);
2. becomes a child subreaper, so a descendant that double-forks is re-parented here, not to init;
3. forks the model's process: its own session, the resource limits, an unprivileged uid when started as
   root, then the code runs in that process (no second interpreter start: that halves a call's cost);
4. waits up to the wall-clock time-out (or until the parent dies), then kills whatever is left of the
   tree and writes one line (exit status, CPU seconds, time-out, processes swept) to the status pipe.

Being pid 1 of the pid namespace (namespaces mode) also means that when this process ends, the kernel
kills every process still in the namespace: nothing the code started can outlive the call.
"""

import os
import resource
import select
import sys
import time

import _ctypes  # not ctypes (which imports functools, collections, ...: ~5-10 ms of every call)
import _signal as signal  # the C module: `signal` imports enum, ~5 ms of every call

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
PR_SET_CHILD_SUBREAPER = 36
# Per-mount flags a remount must repeat (a user namespace refuses to drop locked ones).
KEPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
              "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}

_stop_requested = []


class _CInt(_ctypes._SimpleCData):
    _type_ = "i"


class _CULong(_ctypes._SimpleCData):
    _type_ = "L"


class _Libc:
    _handle = _ctypes.dlopen(None, os.RTLD_NOW)


class _LibcFunction(_ctypes.CFuncPtr):
    """A libc function returning int that saves errno (what ctypes.CDLL(None, use_errno=True) makes)."""

    _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
    _restype_ = _CInt


_libc_mount = _LibcFunction(("mount", _Libc))
_libc_prctl = _LibcFunction(("prctl", _Libc))
_libc_mallopt = _LibcFunction(("mallopt", _Libc))
M_ARENA_MAX = -8


def _mount(source, target, fstype, flags, data=None):
    enc = (lambda s: None if s is None else s.encode())
    if _libc_mount(enc(source), enc(target), enc(fstype), _CULong(flags), enc(data)) != 0:
        err = _ctypes.get_errno()
        raise OSError(err, f"mount {source or ''} on {target}: {os.strerror(err)}")


def _mount_points():
    """(mount point, per-mount flags) of every mount this namespace sees, parents first."""
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8") as table:
        for line in table:
            fields = line.split()
            path = fields[4].encode().decode("unicode_escape")  # spaces etc. are written as \\040
            flags = sum(KEPT_FLAGS.get(option, 0) for option in fields[5].split(","))
            points.append((path, flags))
    return points


def _make_reachable(paths, uid):
    """The unprivileged uid must reach the interpreter and its site-packages: a directory on the way that
    others may not enter (e.g. /root, mode 700) is covered by an empty tmpfs holding only the needed entry,
    bound back from the real one. Everything else in that directory stays hidden."""
    if uid is None:
        return
    for path in paths:
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts) - 1):
            entry = "/" + "/".join(parts[:depth + 1])
            if os.stat(entry).st_mode & 0o001:
                continue
            inner = "/" + "/".join(parts[:depth + 2])
            handle = os.open(inner, os.O_PATH)
            is_dir = os.path.isdir(inner)
            _mount("tmpfs", entry, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
            if is_dir:
                os.mkdir(inner)
            else:
                open(inner, "w").close()
            _mount(f"/proc/self/fd/{handle}", inner, None, MS_BIND | MS_REC)
            os.close(handle)


def _isolate_file_system(config, source):
    folder = config["folder"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates back to the host
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this pid namespace's /proc only
    _make_reachable(config["reach"], config["uid"])
    owner = config["uid"] if config["uid"] is not None else 0
    _mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={config['folder_mb']}m,mode=0700,uid={owner},gid={owner}")
    failed = []
    for path, flags in _mount_points():
        if path != folder:
            try:
                _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
            except OSError as error:
                failed.append((path, error))
    for path, error in failed:
        # A mount hidden under a later one cannot be reached by path; one that still shows writable can.
        if _writable_mount(path):
            raise error
    _mount_own_shm(config["folder_mb"], owner)
    with open(os.path.join(folder, "main.py"), "w", encoding="utf-8") as main:
        main.write(source)
    if config["uid"] is not None:
        os.chown(os.path.join(folder, "main.py"), owner, owner)


def _mount_own_shm(size_mb, owner):
    """A fresh, size-capped, writable /dev/shm of this run's own (POSIX semaphores and shared memory:
    multiprocessing's locks and queues need it), mounted over the read-only one, which it hides: the
    host's /dev/shm is neither readable nor writable from here. No /dev/shm to mount on: none."""
    if not os.path.isdir("/dev/shm"):
        return
    _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
           f"size={size_mb}m,mode=0700,uid={owner},gid={owner}")


def _writable_mount(path):
    try:
        return not os.statvfs(path).f_flag & os.ST_RDONLY
    except OSError:
        return False


def _set_limits(limits):
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    memory = limits["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_mb"] << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"],) * 2)


def _run_code(config, source, runner_fds):
    """In the forked child: limits, uid, then the model's code as ``__main__``; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for fd in runner_fds:
            os.close(fd)
        os.setsid()
        # glibc reserves a 64 MB malloc arena per thread (up to 8 per core): under RLIMIT_AS a few dozen
        # threads would fail on address space that is never used, misread as the process limit
        _libc_mallopt(_CInt(M_ARENA_MAX), _CInt(2))
        _set_limits(config["limits"])
        if config["uid"] is not None:
            os.setgroups([])
            os.setgid(config["uid"])
            os.setuid(config["uid"])
        os.chdir(config["folder"])
        sys.argv = ["main.py"]
        sys.path[0] = config["folder"]  # was the runner's own directory (or "" with -c)
        sys.path.extend(config["site"])
        code = _exec_main(source)
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _exec_main(source):
    namespace = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    try:
        exec(compile(source, "main.py", "exec"), namespace)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop)
    except BaseException as error:  # the model's own error: print it as Python would, without our frame
        import traceback

        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        code = 1
    if "threading" in sys.modules:  # as the interpreter does at exit: wait for non-daemon threads
        sys.modules["threading"]._shutdown()
    import atexit

    atexit._run_exitfuncs()
    return code


def _exit_code(stop):
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code & 0xFF
    print(stop.code, file=sys.stderr)
    return 1


def _children():
    me = os.getpid()
    try:  # the kernel's own list (CONFIG_PROC_CHILDREN); else scan every process's parent
        with open(f"/proc/{me}/task/{me}/children", encoding="ascii") as listing:
            return [int(pid) for pid in listing.read().split()]
    except OSError:
        pass
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == str(me):
                found.append(int(name))
    return found


def _sweep(uid):
    """Kill every process the code left (re-parented here by the subreaper flag); how many there were."""
    try:
        if os.waitpid(-1, os.WNOHANG) == (0, 0):
            pass
    except ChildProcessError:  # no child left, hence no descendant either: the common case, no /proc scan
        return set()
    left = set(_children())
    if uid is not None:
        # kill(-1) as that uid reaches every process it owns, in one step the kernel does not let a fork race
        killer = os.fork()
        if killer == 0:
            try:
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(killer, 0)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        pids = _children()
        left.update(pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return left
        time.sleep(0.002)
    return left


def _wait(pid, timeout_s, wakeup, status_fd):
    """(wait status, rusage, timed out): the child's end, the time-out, the parent's SIGTERM (which writes to
    ``wakeup``) or the parent's death (its end of the status pipe closes), whichever comes first."""
    watcher = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(watcher, select.POLLIN)
    poller.register(wakeup, select.POLLIN)
    poller.register(status_fd, 0)  # a pipe's write end reports POLLERR once nobody can read it
    deadline = time.monotonic() + timeout_s
    parent_gone = False
    while not _stop_requested and not parent_gone:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        events = dict(poller.poll(remaining * 1000))
        if watcher in events:
            _, status, usage = os.wait4(pid, 0)
            return status, usage, False
        parent_gone = status_fd in events
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _, status, usage = os.wait4(pid, 0)
    return status, usage, not (_stop_requested or parent_gone)


def main():
    config = eval(sys.argv[1], {"__builtins__": {}})  # a dict literal written by the parent
    status_fd = config["status_fd"]
    report = {"error": None}
    wakeup, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    signal.signal(signal.SIGTERM, lambda *_: _stop_requested.append(True))
    try:
        with open(os.path.join(config["folder"], "main.py"), encoding="utf-8") as main_file:
            source = main_file.read()
        if config["mounts"]:
            _isolate_file_system(config, source)
        if _libc_prctl(PR_SET_CHILD_SUBREAPER, *(_CULong(value) for value in (1, 0, 0, 0))) != 0:
            raise OSError(_ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        sys.stdout.flush()
        child = os.fork()
        if child == 0:
            _run_code(config, source, (status_fd, wakeup, wakeup_write))
        status, usage, timed_out = _wait(child, config["timeout_s"], wakeup, status_fd)
        left = _sweep(config["uid"]) - {child}
        report.update(returncode=os.waitstatus_to_exitcode(status), timed_out=timed_out,
                      stopped=bool(_stop_requested), cpu_s=usage.ru_utime + usage.ru_stime,
                      max_rss_kb=usage.ru_maxrss, swept=len(left))
    except Exception as error:  # reported to the parent as a sandbox error, never shown as the code's
        report["error"] = f"{type(error).__name__}: {error}"
    try:
        os.write(status_fd, (repr(report) + "\n").encode())
    except BrokenPipeError:
        pass  # the parent is gone; the code's processes are already killed
    os.close(status_fd)


if __name__ == "__main__":
    main()
