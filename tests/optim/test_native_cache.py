"""Issue 59: the C kernel's cache cannot be planted into, and a damaged entry is rebuilt, never loaded.
Each case runs `posttrain.optim.native.load` in a fresh process (a library, once loaded, stays) against a
cache folder of the test's, and has a negative control showing the same file is loaded (or crashes the
loader) without the check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

OTHER_UID = 59059  # a uid of no account: "another user"
needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on PATH")

LOAD = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    from posttrain.optim import native
    library = native.load("adamw8bit")
    print("C" if library is not None and hasattr(library, "adamw8bit_update") else "none", native.last_error)
""")

PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *marker = getenv("PLANTED_MARKER");
    if (marker) { FILE *f = fopen(marker, "w"); if (f) { fputs("ran", f); fclose(f); } }
}
void adamw8bit_update(void) {}
"""


def load_in_a_fresh_process(cache: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "POSTTRAIN_CACHE_DIR": str(cache), **env})


@pytest.fixture(scope="module")
def good_build(tmp_path_factory) -> Path:
    """A cache with a good build: its library's name is the one every later load looks for."""
    cache = tmp_path_factory.mktemp("good-cache")
    out = load_in_a_fresh_process(cache)
    assert out.stdout.startswith("C {}"), out.stdout + out.stderr
    return next((cache / "kernels").glob("adamw8bit-*.so"))


def fresh_cache(tmp_path: Path, good_build: Path) -> Path:
    """A cache holding a copy of the good build and its checksum; returns the library's path in it."""
    kernels = tmp_path / "cache" / "kernels"
    kernels.mkdir(parents=True, mode=0o700)
    for path in (good_build, good_build.with_name(good_build.name + ".sha256")):
        shutil.copy2(path, kernels / path.name)
    return kernels / good_build.name


def planted_library(tmp_path: Path) -> Path:
    source = tmp_path / "planted.c"
    source.write_text(PLANTED)
    library = tmp_path / "planted.so"
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def write_checksum(library: Path) -> None:
    import hashlib

    library.with_name(library.name + ".sha256").write_text(hashlib.sha256(library.read_bytes()).hexdigest() + "\n")


@needs_cc
def test_a_library_planted_by_another_user_in_a_shared_folder_is_never_loaded(tmp_path, good_build):
    if os.geteuid() != 0:
        pytest.skip("needs root to play the other user who owns the shared folder")
    shared = tmp_path / "shared"  # a 1777 cache folder another user made, their library in it
    (shared / "kernels").mkdir(parents=True)
    target = shared / "kernels" / good_build.name
    shutil.copy(planted_library(tmp_path), target)
    write_checksum(target)  # the planter can write the checksum too: ownership is what is checked
    for path in (shared, shared / "kernels", target, target.with_name(target.name + ".sha256")):
        os.chown(path, OTHER_UID, OTHER_UID)
    for path in (shared, shared / "kernels"):
        path.chmod(0o1777)
    marker = tmp_path / "constructor-ran"
    out = load_in_a_fresh_process(shared, PLANTED_MARKER=str(marker))
    assert not marker.exists(), "the planted library's constructor ran in this (root) process"
    assert out.stdout.splitlines()[-1] == "C {}", out.stdout + out.stderr  # a private build, still the C kernel
    assert f"owned by uid {OTHER_UID}" in out.stdout and "private temporary folder" in out.stdout
    assert sorted(p.name for p in (shared / "kernels").iterdir()) == sorted([target.name, target.name + ".sha256"])
    # control: the same library and checksum, owned by this user in a private folder, is loaded (so the
    # refusal above came from the ownership check, not from a broken file)
    for path in (shared, shared / "kernels", target, target.with_name(target.name + ".sha256")):
        os.chown(path, os.geteuid(), os.getegid())
    (shared / "kernels").chmod(0o700)
    shared.chmod(0o755)
    load_in_a_fresh_process(shared, PLANTED_MARKER=str(marker))
    assert marker.read_text() == "ran"


@needs_cc
def test_a_file_of_another_user_or_writable_by_others_in_our_folder_is_rebuilt(tmp_path, good_build):
    library = fresh_cache(tmp_path, good_build)
    library.chmod(0o666)
    out = load_in_a_fresh_process(tmp_path / "cache")
    assert out.stdout.splitlines()[-1] == "C {}" and "mode 666" in out.stdout and "rebuilding" in out.stdout
    assert (library.stat().st_mode & 0o777) == 0o644  # replaced by a new build
    if os.geteuid() == 0:
        os.chown(library, OTHER_UID, OTHER_UID)
        out = load_in_a_fresh_process(tmp_path / "cache")
        assert f"owned by uid {OTHER_UID}" in out.stdout and library.stat().st_uid == 0


@needs_cc
def test_a_folder_writable_by_others_is_not_used(tmp_path, good_build):
    library = fresh_cache(tmp_path, good_build)
    library.parent.chmod(0o777)
    out = load_in_a_fresh_process(tmp_path / "cache")
    assert out.stdout.splitlines()[-1] == "C {}" and "is writable by others (mode 777)" in out.stdout
    assert "private temporary folder" in out.stdout


@needs_cc
def test_a_library_cut_short_is_rebuilt_not_loaded(tmp_path, good_build):
    library = fresh_cache(tmp_path, good_build)
    os.truncate(library, library.stat().st_size // 2)  # a copy cut short; its checksum is the full file's
    out = load_in_a_fresh_process(tmp_path / "cache")
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "C {}", out.stdout + out.stderr
    assert "does not match its checksum" in out.stdout and library.stat().st_size == good_build.stat().st_size
    # control: loading the cut file as the old cache did kills the process (SIGBUS) or fails
    os.truncate(library, library.stat().st_size // 2)
    crash = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(library)!r}); print('loaded')"],
                           capture_output=True, text=True, timeout=60)
    assert crash.returncode != 0 and "loaded" not in crash.stdout


@needs_cc
def test_garbage_is_rebuilt_once_and_the_rebuild_is_reused(tmp_path, good_build):
    library = fresh_cache(tmp_path, good_build)
    library.write_bytes(b"garbage" * 1000)
    write_checksum(library)  # even with a checksum that matches: it does not load
    out = load_in_a_fresh_process(tmp_path / "cache")
    assert out.stdout.splitlines()[-1] == "C {}" and "does not load" in out.stdout, out.stdout + out.stderr
    stamp = library.stat().st_mtime_ns
    again = load_in_a_fresh_process(tmp_path / "cache")
    assert again.stdout == "C {}\n" and library.stat().st_mtime_ns == stamp  # no line, no rebuild


@needs_cc
def test_a_library_without_the_kernels_symbol_is_rebuilt(tmp_path, good_build):
    library = fresh_cache(tmp_path, good_build)
    source = tmp_path / "other.c"
    source.write_text("int something_else(void) { return 1; }\n")
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    write_checksum(library)
    out = load_in_a_fresh_process(tmp_path / "cache")
    assert out.stdout.splitlines()[-1] == "C {}" and "lacks adamw8bit_update" in out.stdout, out.stdout + out.stderr
    assert "Traceback" not in out.stderr


@needs_cc
def test_a_compiler_killed_mid_build_leaves_nothing_and_a_dead_build_is_swept(tmp_path):
    real = shutil.which(os.environ.get("CC", "cc"))
    killed = tmp_path / "killed-cc"
    killed.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then exec {real} --version; fi\n"
                      "for a; do if [ \"$prev\" = -o ]; then echo partial > \"$a\"; fi; prev=$a; done\nkill -9 $$\n")
    killed.chmod(0o755)
    cache = tmp_path / "cache"
    (cache / "kernels").mkdir(parents=True, mode=0o700)
    dead = cache / "kernels" / ".build-999999999-abc"  # a build folder of a process that no longer exists
    dead.mkdir()
    (dead / "adamw8bit-x.so").write_text("partial")
    out = load_in_a_fresh_process(cache, CC=str(killed))
    assert out.stdout.startswith("none") and "failed on adamw8bit.c" in out.stdout, out.stdout + out.stderr
    assert list((cache / "kernels").iterdir()) == []  # neither its own temporary nor the dead one's
