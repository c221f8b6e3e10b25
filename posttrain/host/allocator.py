"""Freed memory kept for reuse: glibc's malloc told not to hand large blocks back to the kernel.

glibc serves every allocation above its ``mmap`` threshold (128 KiB, rising to at most 32 MiB)
with a mapping of its own and unmaps it on ``free``. A training step allocates and frees the same
large tensors again and again (the ``[49152, 576]`` embedding gradient and its bf16 casts, the
``[t, 49152]`` logit chunks), so each one arrives as fresh pages that the kernel zero-fills on first
touch, taking about twice as long to allocate as a reused block. ``keep_freed_memory`` turns ``mmap``
allocation off and raises the trim threshold, so freed blocks stay in the heap and are reused (the
process keeps its peak footprint, which a training run reaches every step anyway): a faster step
(``benchmarks/bench_step.py``; the figures in benchmarks/README.md, "Host").

Kernel caches bounded: oneDNN (the bf16 matmuls on CPU) keeps a compiled primitive for every matmul shape it
meets, and PyTorch's oneDNN glue another entry, each up to 1024 of them (~0.3 MB an entry). A training run
meets new shapes every step (response lengths, shrinking decoding batches), so both caches grow by ~20 MB a
step until full, ~0.6 GB held for nothing. ``keep_freed_memory`` first caps both at `KERNEL_CACHE_ENTRIES`
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``; a user's own setting stays), more than one
step's distinct shapes, so the reuse within a phase is kept.

Each Ray rank calls it; a one-process CPU run does when ``host_memory`` is ``speed`` or ``memory``
(`posttrain.distributed.placement.InProcess`): by default (``balanced``) it holds the ``mmap`` threshold instead
(`map_large_blocks`), which on the built-in run peaks 0.3-0.45 GB lower at the same step time
(`posttrain.host.memory_plan`). The command-line entry points bound the kernel caches before torch's first
matmul (`bound_kernel_caches`). Nothing is done off glibc, or when the user configured the allocator (a
``MALLOC_*`` tuning variable, ``GLIBC_TUNABLES``, or a preloaded allocator such as jemalloc or tcmalloc).

Kept memory is also memory held: what a passing peak freed (loading and dequantising the models,
a long validation) would stay resident for the rest of the run, and the holes that a step leaves
between the tensors that outlive it (gradients, Adam's moments) add up from step to step.
``release_freed_memory`` (glibc's ``malloc_trim``) hands the free pages of the heap back to the
kernel at the points where the next phase's reuse is not worth what they hold.
``mapped_allocations`` gives the blocks allocated inside a ``with`` block mappings of their own
again, for short-lived buffers of unusual sizes (the lean decoder's packed weights, over-allocated
2x by MKL and half untouched) that would otherwise leave the heap holes every later phase touches.
``heap_allocations`` is its opposite under `map_large_blocks`: every block from the heap, for a phase that
allocates the same large buffers again and again (the update's micro-batches), trimmed after it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
from typing import Iterator

__all__ = ["KERNEL_CACHE_ENTRIES", "MMAP_THRESHOLD_BYTES", "bound_kernel_caches", "heap_allocations", "keep_freed_memory",
           "map_large_blocks", "mapped_allocations", "release_freed_memory"]

GLIBC_MMAP_MAX = 65536
"""glibc's default ``M_MMAP_MAX``: mappings allowed at once."""

_kept = False  # keep_freed_memory() turned mmap allocation off in this process
_held = False  # map_large_blocks() held the mmap threshold in this process

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # mallopt parameters (malloc.h)
TRIM_THRESHOLD_BYTES = 2**31 - 1
"""Free memory at the heap's top is returned to the kernel only beyond this (the largest int mallopt takes)."""
USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                 "GLIBC_TUNABLES", "LD_PRELOAD")


KERNEL_CACHE_ENTRIES = 128
"""Entries each kernel cache keeps (module docstring): more distinct matmul shapes than one step meets."""
KERNEL_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches() -> None:
    """Cap oneDNN's and PyTorch's per-shape kernel caches (module docstring), unless the user set them. They
    read the variables at their first use, so this must run before the process's first matmul."""
    for name in KERNEL_CACHES:
        os.environ.setdefault(name, str(KERNEL_CACHE_ENTRIES))


MMAP_THRESHOLD_BYTES = 8 << 20
"""Blocks from this size up get mappings of their own under `map_large_blocks` (where the heap has no room)."""


@functools.cache  # once per process
def map_large_blocks(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """glibc's ``mmap`` threshold held at ``threshold`` (True when set): a block from that size up that the heap's
    free memory cannot hold gets a mapping of its own, unmapped when freed; the rest comes from the heap and is
    reused.

    glibc's own threshold starts at 128 KiB and rises to the size of each mapped block freed, up to 32 MiB:
    after the first update, a micro-batch's logit chunks and activations come from the heap, and the holes
    they leave between longer-lived tensors are resident memory the next phases cannot always fill. Held
    at 8 MiB, the multi-turn retry run (3 steps, Zen 4) peaked at 2.94 GB against 3.13 GB at glibc's own
    (3.05 at 16 MiB; 2.62 at 1 MiB, but with steps 40% slower: every block fresh, zero-filled pages).

    Setting the threshold also stops glibc's dynamic pairing, which raises the trim threshold with it (to
    twice the mmap threshold): left at its 128 KiB, every free at the heap's top handed the pages back and
    the next micro-batch faulted them in again, zero-filled (the retry run's update: 14 GB of page faults
    in 4 steps, 1.84 s per 1000 tokens; 7.4 GB and 1.69 s with the top kept). So the top is kept too
    (`TRIM_THRESHOLD_BYTES`); the phases that leave memory nobody reuses return it themselves
    (`release_freed_memory`: after loading, each rollout, validation and update, and before each optimizer
    step). Nothing is done when the user configured the allocator (`USER_SETTINGS`) or off glibc."""
    if any(os.environ.get(name) for name in USER_SETTINGS):
        return False
    libc = _glibc()
    global _held
    _held = (libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
             and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)))
    return _held


@contextlib.contextmanager
def heap_allocations() -> Iterator[None]:
    """Under `map_large_blocks`, every block allocated inside the block comes from the heap, whatever its size;
    otherwise nothing changes. For a phase that allocates and frees the same large buffers again and again (the
    update's micro-batches: logit chunks, activations): mapped, each came back as fresh zero-filled pages,
    every micro-batch. The caller returns the heap's free pages after it (`release_freed_memory`)."""
    libc = _glibc() if _held else None
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_MAX, 0)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_MAX, GLIBC_MMAP_MAX)


@functools.cache  # once per process: later callers (CLI, then main_ppo, then a rank) get the first answer
def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse (module docstring); True when it now does. The kernel caches
    are bounded first (`bound_kernel_caches`), whatever the allocator."""
    bound_kernel_caches()
    if any(os.environ.get(name) for name in USER_SETTINGS):
        return False  # the user chose the allocator's behaviour
    libc = _glibc()
    if libc is None:
        return False
    global _kept
    _kept = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _kept


@contextlib.contextmanager
def mapped_allocations() -> Iterator[None]:
    """Large blocks allocated inside the block get their own mappings (unmapped when freed, whenever
    that is), where :func:`keep_freed_memory` had turned that off; otherwise nothing changes."""
    libc = _glibc() if _kept else None
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_MAX, GLIBC_MMAP_MAX)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_MAX, 0)


def release_freed_memory() -> bool:
    """Return the heap's free pages to the kernel (``malloc_trim(0)``: every free chunk, not only the
    heap's top); True when glibc released something. A no-op off glibc."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


@functools.cache
def _glibc():
    """The process's C library when it is glibc (it has ``gnu_get_libc_version``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - raises AttributeError off glibc (musl, macOS)
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc
