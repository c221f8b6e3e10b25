"""C kernels of this package, built once per machine with the system's C compiler and loaded with ctypes.

A kernel is a ``.c`` file beside this one. Its shared library is built for this CPU (``-march=native``)
into ``<cache>/kernels/`` (`posttrain.host.cache.cache_root`) under a name that hashes the source, the
compiler, the flags and the CPU's model and flags, so an edited source, another compiler or another CPU
(a cache folder shared by a cluster's nodes) never loads a stale or foreign build. A build takes about
a second; two processes building at once each write their own file and rename it into place.

Why not ``torch.compile`` for the same fusion: inductor fused the torch form of the 8-bit update
(`posttrain.optim.adamw8bit._update_blocks`) to 0.16 s for 56M values (0.29 s eager; this kernel 0.10 s),
but importing and running it kept ~0.16 GB more resident for the rest of the run and took 2-18 s at
start-up, and its graph recompiled each step unless the step size was kept out of any ``alpha=``.

The cache is trusted only as far as it can be: its ``kernels`` folder and each library must be owned by
this process's user and writable by nobody else (a folder shared with, or made by, another user is not
used: the build goes to a private temporary folder instead); each library has its SHA-256 beside it
(``.so.sha256``), checked on the very file descriptor that is then loaded, so a file cut short (SIGBUS on
load), garbage, or swapped in after the check is never loaded; such a file, or one that does not load or
lacks the kernel's symbol, is rebuilt under a new name and replaces it. Builds happen in a temporary
folder of their own, removed after (and swept where its process died mid-build). Each of these is one
logged line saying what was wrong.

`load` returns None, with the reason in `last_error`, where there is no C compiler or the build fails:
the caller keeps its torch code (the same arithmetic, slower) and says so.
"""

from __future__ import annotations

import _ctypes
import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from posttrain.host.cache import cache_root

__all__ = ["FLAGS", "SYMBOLS", "load", "last_error"]

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
"""``-ffp-contract=off``: the compiler fuses no multiply-add of its own, so each operation rounds as in torch's
elementwise kernels (a kernel writes ``fmaf`` where torch's own kernel fuses); ``-fno-math-errno``: ``sqrtf``
becomes one vector instruction (nothing here reads errno)."""

SYMBOLS = {"adamw8bit": ("adamw8bit_update",)}
"""The functions each kernel's library must export; one without them is rebuilt."""

last_error: dict[str, str] = {}
"""Why `load` returned None, per kernel name."""

_loaded: dict[str, ctypes.CDLL | None] = {}
_open_libraries: list[int] = []  # descriptors of the loaded libraries (see `_load_checked`)
BUILD_PREFIX = ".build-"  # a build's own folder in the kernels folder: .build-<pid>-<random>


class _Untrusted(Exception):
    """A cache entry that must not be loaded (the message says why)."""


def load(name: str) -> ctypes.CDLL | None:
    """The library built from ``<name>.c`` beside this file (built now if this machine has none yet), or
    None when it cannot be built (`last_error` says why)."""
    if name not in _loaded:
        _loaded[name] = _build_and_load(name)
    return _loaded[name]


def _build_and_load(name: str) -> ctypes.CDLL | None:
    source = Path(__file__).with_name(f"{name}.c")
    asked = os.environ.get("CC", "cc")
    compiler = shutil.which(asked)
    if compiler is None:
        last_error[name] = f"no C compiler ({asked!r} is not on PATH)"
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("|".join([source.read_text(), compiler, version, *FLAGS, _cpu_flags()]).encode())
        folder = cache_root() / "kernels"
        library = folder / f"{name}-{key.hexdigest()[:16]}.so"
        try:
            _trusted_folder(folder)
        except _Untrusted as why:
            logger.warning("kernel cache not used: %s; %s is built in a private temporary folder instead", why, name)
            with tempfile.TemporaryDirectory(prefix="posttrain-kernel-") as private:
                return _build_into(compiler, source, Path(private) / library.name, name)
        _sweep_dead_builds(folder)
        if library.exists() or library.is_symlink():
            try:
                return _load_checked(library, name)
            except _Untrusted as why:
                logger.warning("kernel cache: %s; rebuilding %s", why, library.name)
        return _build_into(compiler, source, library, name)
    except (OSError, subprocess.SubprocessError, _Untrusted) as error:
        last_error[name] = f"building {source.name} failed: {error}"
        return None


def _build_into(compiler: str, source: Path, library: Path, name: str) -> ctypes.CDLL | None:
    """Compile in a build folder of its own beside ``library`` (removed after, whatever happens), write the
    checksum, move both into place (a new inode: a process that loaded the old file keeps it), load."""
    build = Path(tempfile.mkdtemp(prefix=f"{BUILD_PREFIX}{os.getpid()}-", dir=library.parent))
    try:
        partial = build / library.name
        built = subprocess.run([compiler, *FLAGS, "-o", str(partial), str(source), "-lm"],
                               capture_output=True, text=True, timeout=300)
        if built.returncode != 0:
            last_error[name] = f"{compiler} failed on {source.name}: {built.stderr.strip()[-500:]}"
            return None
        os.chmod(partial, 0o644)
        checksum = build / f"{library.name}.sha256"
        checksum.write_text(hashlib.sha256(partial.read_bytes()).hexdigest() + "\n")
        os.chmod(checksum, 0o644)
        os.replace(checksum, _checksum_path(library))
        os.replace(partial, library)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    try:
        return _load_checked(library, name)
    except _Untrusted as why:
        last_error[name] = f"the library just built does not load: {why}"
        return None


def _trusted_folder(folder: Path) -> None:
    """Make ``folder`` (mode 700) or accept it only as this user's and writable by nobody else; its parent
    may be writable by others only with the sticky bit (as /tmp), so nobody can swap the folder itself."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    _owned_and_private(folder, "folder", stat.S_ISDIR)
    parent = os.stat(folder.parent)
    if parent.st_uid not in (0, os.geteuid()):
        raise _Untrusted(f"{folder.parent} (holding {folder.name}/) is owned by uid {parent.st_uid}, who may swap it")
    if parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX:
        raise _Untrusted(f"{folder.parent} (holding {folder.name}/) is writable by others (mode "
                         f"{stat.S_IMODE(parent.st_mode):o}) without the sticky bit")


def _owned_and_private(path: Path, what: str, kind) -> os.stat_result:
    info = os.lstat(path)
    if not kind(info.st_mode):
        raise _Untrusted(f"{path} is not a plain {what} (a link or another kind of file)")
    if info.st_uid != os.geteuid():
        raise _Untrusted(f"the {what} {path} is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})")
    if info.st_mode & 0o022:
        raise _Untrusted(f"the {what} {path} is writable by others (mode {stat.S_IMODE(info.st_mode):o})")
    return info


def _checksum_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _load_checked(library: Path, name: str) -> ctypes.CDLL:
    """Open ``library`` once, check owner, mode and SHA-256 on that descriptor, load that very file
    (``/proc/self/fd/N``: a swap after the check changes nothing), check its symbols. The descriptor of a
    loaded library stays open: the loader knows a library by that name, which must not come back for another."""
    handle = os.open(library, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        loaded = _load_descriptor(handle, library)
        missing = [symbol for symbol in SYMBOLS.get(name, ()) if not hasattr(loaded, symbol)]
        if missing:
            _ctypes.dlclose(loaded._handle)
            raise _Untrusted(f"{library.name} lacks {', '.join(missing)}")
    except BaseException:
        os.close(handle)
        raise
    _open_libraries.append(handle)
    return loaded


def _load_descriptor(handle: int, library: Path) -> ctypes.CDLL:
    info = os.fstat(handle)
    if not stat.S_ISREG(info.st_mode):
        raise _Untrusted(f"{library} is not a plain file")
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise _Untrusted(f"{library} is owned by uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):o}; "
                         f"only this user's (uid {os.geteuid()}) library, writable by nobody else, is loaded")
    try:
        _owned_and_private(_checksum_path(library), "checksum file", stat.S_ISREG)
        expected = _checksum_path(library).read_text().strip()
    except FileNotFoundError:
        raise _Untrusted(f"{library.name} has no checksum beside it") from None
    digest = hashlib.sha256()
    with os.fdopen(os.dup(handle), "rb") as data:
        for block in iter(lambda: data.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise _Untrusted(f"{library.name} does not match its checksum ({info.st_size} bytes: cut short, "
                         "damaged or replaced)")
    try:
        return ctypes.CDLL(f"/proc/self/fd/{handle}")
    except OSError as error:
        raise _Untrusted(f"{library.name} does not load ({error})") from None


def _sweep_dead_builds(folder: Path) -> None:
    """Remove the build folders of processes that died mid-build (a compiler killed, a process killed)."""
    for build in folder.glob(f"{BUILD_PREFIX}*"):
        pid = build.name[len(BUILD_PREFIX):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(build, ignore_errors=True)


def _cpu_flags() -> str:
    """The CPU's model name and feature flags (what ``-march=native`` compiled for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return "|".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
