"""The program that runs inside the sandbox, around the model's code.

`posttrain.sandbox.local` starts it as ``python -I -S <this file, compiled> <config>`` (under ``unshare``
when namespaces are on), so it imports nothing but the standard library and is never imported by the
training process. The config and the report are Python literals, not JSON: importing json (and re) would
cost ~10 ms of every call. It:

1. joins the run's memory cgroup (where the parent made one); (namespaces) as root of fresh
   mount/pid/ipc/net namespaces, builds a new root (`_build_root`: system folders, the interpreter's paths,
   a minimal /dev, a new /proc), pivots into it and drops the old one, mounts a size-capped tmpfs as the
   working folder, remounts every other mount read-only, then a fresh size-capped tmpfs of the run's own
   on /dev/shm (multiprocessing's semaphores live there);
2. becomes a child subreaper, so a descendant that double-forks is re-parented here, not to init;
3. forks the model's process: its own session, the resource limits, an unprivileged uid when started as
   root (else, in a user namespace, no capabilities), no new privileges, then the code runs in that
   process (no second interpreter start: that halves a call's cost);
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
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 24, 47, 4
CAPABILITY_VERSION_3 = 0x20080522
# The host folders the code's interpreter needs whole (read-only); everything else of the host is absent.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/sys")
DEVICES = ("null", "zero", "full", "random", "urandom")
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
_libc_umount2 = _LibcFunction(("umount2", _Libc))
_libc_capset = _LibcFunction(("capset", _Libc))
_libc_pivot_root = _LibcFunction(("pivot_root", _Libc))  # glibc >= 2.x exports it; see _pivot_into
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


def _mapped_library_dirs():
    """Folders of the shared libraries this interpreter has loaded (libpython, ...): an extension module
    imported later may need a neighbour of theirs."""
    found = set()
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/") and ".so" in fields[5]:
                found.add(os.path.dirname(fields[5].rstrip("\n")))
    return found


def _needed_paths(reach):
    """The paths bound into the new root besides the system folders: ``reach`` (interpreter, prefixes,
    site-packages) and the loaded libraries' folders, none under another or under a system folder."""
    paths = sorted({os.path.realpath(p) for p in (*reach, *_mapped_library_dirs()) if os.path.exists(p)})
    kept = []
    for path in paths:
        covered = [*SYSTEM_PATHS, *kept]
        if path not in ("/", "/proc", "/dev") and not any(path == c or path.startswith(c + "/") for c in covered):
            kept.append(path)
    return kept


def _bind_into(root, path, handle, is_dir, recursive=True):
    """``path`` (an O_PATH ``handle`` opened before anything was covered) bound at ``root + path``, on
    parents made empty in ``root``: nothing beside ``path`` in any of them shows."""
    target = root + path
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if is_dir:
        os.makedirs(target, mode=0o755, exist_ok=True)
    elif not os.path.exists(target):
        open(target, "w").close()
    try:
        _mount(f"/proc/self/fd/{handle}", target, None, MS_BIND | (MS_REC if recursive else 0))
    except OSError:
        if recursive:
            raise
        # a user namespace may not bind a folder without the mounts locked inside it: all of them, then
        _mount(f"/proc/self/fd/{handle}", target, None, MS_BIND | MS_REC)


def _build_root(folder, reach):
    """A new root file system on a tmpfs (mounted over the run's folder, which the run replaces anyway):
    the system folders (/usr, /etc, /lib*, /bin, /sbin, /sys), exactly the ``reach`` paths, a /dev of
    null, zero, full, random, urandom, a fresh /proc and nothing else: no home, no /tmp or /var of the
    host, no /run (path sockets), no other mount. Returns the new root's path (pivoted into by the caller)."""
    needed = [(p, os.open(p, os.O_PATH), os.path.isdir(p)) for p in _needed_paths(reach)]
    system = [(p, os.open(p, os.O_PATH | os.O_NOFOLLOW), os.path.islink(p), os.path.isdir(p))
              for p in SYSTEM_PATHS if os.path.lexists(p)]
    devices = [(d, os.open(f"/dev/{d}", os.O_PATH)) for d in DEVICES if os.path.exists(f"/dev/{d}")]
    root = folder
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for path, handle, is_link, is_dir in system:
        if is_link:  # a merged /usr's /bin -> usr/bin: the same link
            os.symlink(os.readlink(path), root + path)
        elif is_dir:  # /sys alone where allowed (fewer mounts to set up and tear down), not what is mounted in it
            _bind_into(root, path, handle, True, recursive=path != "/sys")
        os.close(handle)
    for path, handle, is_dir in needed:
        _bind_into(root, path, handle, is_dir)
        os.close(handle)
    os.mkdir(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this pid namespace's only
    os.mkdir(root + "/dev")
    _mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=64k")
    os.mkdir(root + "/dev/shm")
    for name, handle in devices:
        open(f"{root}/dev/{name}", "w").close()
        _mount(f"/proc/self/fd/{handle}", f"{root}/dev/{name}", None, MS_BIND)
        os.close(handle)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(root + "/tmp", mode=0o1777, exist_ok=True)
    os.makedirs(root + folder, mode=0o755, exist_ok=True)
    return root


def _pivot_into(root):
    """Make ``root`` the file system's root and drop the old one whole (detached: nothing of it is left
    to reach, not even by a chroot escape)."""
    os.chdir(root)
    os.mkdir(".old-root")
    if _libc_pivot_root(b".", b".old-root") != 0:
        err = _ctypes.get_errno()
        raise OSError(err, f"pivot_root: {os.strerror(err)}")
    os.chdir("/")
    if _libc_umount2(b"/.old-root", _CInt(MNT_DETACH)) != 0:
        err = _ctypes.get_errno()
        raise OSError(err, f"umount the old root: {os.strerror(err)}")
    os.rmdir("/.old-root")


def _isolate_file_system(config, source):
    folder = config["folder"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates back to the host
    _pivot_into(_build_root(folder, config["reach"]))
    owner = config["uid"] if config["uid"] is not None else 0
    _mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={config['folder_mb']}m,mode=0700,uid={owner},gid={owner}")
    failed = []
    for path, flags in _mount_points():
        if path not in (folder, "/dev/shm"):
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


def _drop_capabilities():
    """Every capability gone, for good (bounding set, ambient, effective, permitted, inheritable): what
    becoming a uid other than 0 does for a root-started run, for the code that stays uid 0 of a user
    namespace (which could otherwise remount its read-only binds writable, or unmount the walls)."""
    for cap in range(64):
        if _libc_prctl(PR_CAPBSET_DROP, *(_CULong(value) for value in (cap, 0, 0, 0))) != 0:
            break  # past the kernel's last capability
    _libc_prctl(PR_CAP_AMBIENT, *(_CULong(value) for value in (PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)))
    header = CAPABILITY_VERSION_3.to_bytes(4, sys.byteorder) + bytes(4)  # this thread; then 2 x 3 zero words
    if _libc_capset(header, bytes(24)) != 0:
        raise OSError(_ctypes.get_errno(), "capset")


def _join_cgroup(procs_file):
    """Move this process (and so everything it starts) into the run's memory cgroup; returns a handle on
    this process's oom_score_adj, opened now (the /proc here is read-only later), for `_spare_runner`."""
    with open(procs_file, "w", encoding="ascii") as procs:
        procs.write("0")
    return os.open("/proc/self/oom_score_adj", os.O_WRONLY)


def _spare_runner(oom_adj):
    """Once the code is forked (it keeps the default score): the code, not the runner that reports, is what
    the cgroup's out-of-memory killer picks."""
    try:
        os.write(oom_adj, b"-1000")
    except OSError:
        pass  # lowering it needs real root; the runner's few MB are then rarely the largest anyway
    os.close(oom_adj)


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
        elif config["mounts"]:
            _drop_capabilities()  # root of a user namespace: no remount, no unmount, no new namespace
        if _libc_prctl(PR_SET_NO_NEW_PRIVS, *(_CULong(value) for value in (1, 0, 0, 0))) != 0:
            raise OSError(_ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
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
        oom_adj = _join_cgroup(config["cgroup"]) if config["cgroup"] else None
        if config["mounts"]:
            _isolate_file_system(config, source)
        if _libc_prctl(PR_SET_CHILD_SUBREAPER, *(_CULong(value) for value in (1, 0, 0, 0))) != 0:
            raise OSError(_ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        sys.stdout.flush()
        child = os.fork()
        if child == 0:
            _run_code(config, source, (status_fd, wakeup, wakeup_write, *([oom_adj] if oom_adj is not None else [])))
        if oom_adj is not None:
            _spare_runner(oom_adj)
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
