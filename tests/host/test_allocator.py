"""Freed memory stays in the heap for reuse (posttrain/host/allocator.py), measured with glibc's mallinfo2."""

import subprocess
import sys

import pytest

from posttrain.host.allocator import _glibc

LIBC = """
import ctypes
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ('arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks',
                                              'fsmblks', 'uordblks', 'fordblks', 'keepcost')]
libc = ctypes.CDLL('libc.so.6')
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.mallinfo2.restype = MallInfo2
"""
"""glibc's malloc, free and mallinfo2 for the probes below."""


def _applied_if(mode: str, function: str) -> str:
    """Probe text: with ``mode`` as its argument the probe calls ``posttrain.host.allocator.<function>()`` and
    prints its answer, else prints False (the negative control)."""
    return f"""
import sys
if sys.argv[1] == {mode!r}:
    from posttrain.host.allocator import {function}
    print({function}())
else:
    print(False)
"""


def _run_probe(probe: str, mode: str, **env) -> list[str]:
    """``probe``'s printed words, run as a fresh interpreter with ``mode`` as its argument, without the
    allocator settings of this environment (``env`` added)."""
    import os

    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES",)}
    return subprocess.run([sys.executable, "-c", probe, mode], capture_output=True, text=True, check=True,
                          env={**clean, **env}).stdout.split()


# Allocates and frees 256 MiB through malloc, then prints the heap's free bytes (mallinfo2().fordblks):
# kept for reuse, they are all there; served by mmap (glibc's default for large blocks), none are.
PROBE = LIBC + _applied_if("keep", "keep_freed_memory") + """
block = libc.malloc(256 << 20)
ctypes.memset(block, 1, 256 << 20)
libc.free(ctypes.c_void_p(block))
print(libc.mallinfo2().fordblks >> 20)
"""


def _probe(mode: str, **env) -> tuple[str, int]:
    applied, free_mib = _run_probe(PROBE, mode, **env)
    return applied, int(free_mib)


needs_glibc = pytest.mark.skipif(_glibc() is None or not hasattr(_glibc(), "mallinfo2"),
                                 reason="glibc >= 2.33 (mallinfo2) only")


@needs_glibc
def test_freed_block_is_kept_for_reuse():
    applied, free_mib = _probe("keep")
    assert applied == "True" and free_mib >= 256


@needs_glibc
def test_without_it_glibc_returns_the_block():  # the negative control: the probe can tell the two apart
    applied, free_mib = _probe("default")
    assert applied == "False" and free_mib < 64


@needs_glibc
def test_a_users_allocator_setting_is_left_alone():
    applied, free_mib = _probe("keep", MALLOC_MMAP_THRESHOLD_="65536")
    assert applied == "False" and free_mib < 64


# Keeps a freed 256 MiB block (keep_freed_memory), then prints this process's resident MiB before and
# after release_freed_memory (or after nothing, the negative control).
RELEASE_PROBE = """
import ctypes, sys
from posttrain.host.allocator import keep_freed_memory, release_freed_memory
from posttrain.host.resident import current_resident_bytes
assert keep_freed_memory()
libc = ctypes.CDLL('libc.so.6')
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
block = libc.malloc(256 << 20)
ctypes.memset(block, 1, 256 << 20)
guard = libc.malloc(1 << 20)  # keeps the block off the heap's top, where the trim threshold would not apply
libc.free(ctypes.c_void_p(block))
before = current_resident_bytes() >> 20
if sys.argv[1] == 'release':
    release_freed_memory()
print(before, current_resident_bytes() >> 20)
"""


@pytest.mark.parametrize("release", [True, False])
@needs_glibc
def test_release_hands_kept_memory_back(release):
    before, after = map(int, _run_probe(RELEASE_PROBE, "release" if release else "keep"))
    if release:
        assert before - after >= 240  # the freed block's pages went back to the kernel
    else:
        assert before - after < 16  # negative control: kept (resident) without the release


# Under keep_freed_memory, a 256 MiB block allocated and freed inside mapped_allocations (or outside it, the
# negative control); prints the heap's free MiB and this process's resident MiB after the free.
MAPPED_PROBE = LIBC + """
import contextlib, sys
from posttrain.host.allocator import keep_freed_memory, mapped_allocations
from posttrain.host.resident import current_resident_bytes
assert keep_freed_memory()
base = current_resident_bytes() >> 20
with mapped_allocations() if sys.argv[1] == 'mapped' else contextlib.nullcontext():
    block = libc.malloc(256 << 20)
    ctypes.memset(block, 1, 256 << 20)
    guard = libc.malloc(1 << 20)
libc.free(ctypes.c_void_p(block))  # freed after the block, as a phase's tensors may be
print(libc.mallinfo2().fordblks >> 20, (current_resident_bytes() >> 20) - base)
"""


@pytest.mark.parametrize("mapped", [True, False])
@needs_glibc
def test_a_block_allocated_memory_first_goes_back_to_the_kernel_when_freed(mapped):
    """What ``host_memory=memory`` relies on (posttrain.distributed.placement.memory_first): the block has a mapping
    of its own, unmapped at its free; kept for reuse otherwise (the negative control), still resident."""
    free_mib, grown_mib = map(int, _run_probe(MAPPED_PROBE, "mapped" if mapped else "kept"))
    if mapped:
        assert free_mib < 64 and grown_mib < 64
    else:
        assert free_mib >= 256 and grown_mib >= 240


# Runs a bf16 linear layer forward and backward over 300 row counts (a new matmul shape each time, as a
# training run meets new sequence lengths every step) and prints how much malloc holds after the first 60
# and after all of them: oneDNN's and PyTorch's per-shape kernel caches grow by ~0.9 MB a shape until full.
CACHE_PROBE = LIBC + """
import os, sys
if sys.argv[1] == 'bounded':
    from posttrain.host.allocator import bound_kernel_caches
    bound_kernel_caches()
import torch
torch.set_num_threads(1)
def in_use():
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) >> 20
layer = torch.nn.Linear(64, 96)
sizes = []
for rows in range(1, 301):
    with torch.autocast('cpu', dtype=torch.bfloat16):
        layer(torch.randn(rows, 64, requires_grad=True)).sum().backward()
    if rows in (60, 300):
        sizes.append(in_use())
print(sizes[0], sizes[1])
"""


def _cache_growth(mode: str, **env) -> int:
    import os

    clean = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", CACHE_PROBE, mode], capture_output=True, text=True, check=True,
                         env={**clean, **env}).stdout.split()
    return int(out[1]) - int(out[0])


@needs_glibc
def test_kernel_caches_stop_growing_once_bounded():
    """240 more shapes after the first 60: bounded (128 entries each), malloc holds about what it held; the
    control (a user's own setting of 1024, torch's default) grows by tens of MB, and the user's value is kept."""
    bounded = _cache_growth("bounded")
    control = _cache_growth("bounded", ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024", LRU_CACHE_CAPACITY="1024")
    if control <= 5:  # seen on a Zen 3 (no avx512): these fp32 shapes add nothing to oneDNN's cache, bounded or not
        pytest.skip(f"the control grew by {control} MB: this CPU's kernels keep no per-shape cache to bound")
    assert control > 4 * max(bounded, 5), (bounded, control)


BLOCK_12_MIB = """
from posttrain.host.resident import current_resident_bytes
def written_12_mib():  # a 1 MiB block allocated after it, so that it is not the heap's top
    block = libc.malloc(12 << 20)
    ctypes.memset(block, 1, 12 << 20)
    libc.malloc(1 << 20)
    return block
def free_and_report(block):  # prints the heap's free MiB and the MiB that left the resident set with the free
    before = current_resident_bytes() >> 20
    libc.free(ctypes.c_void_p(block))
    print(libc.mallinfo2().fordblks >> 20, before - (current_resident_bytes() >> 20))
"""
"""Probe text: a written 12 MiB block that is not the heap's top, and its free with what it returned."""

# A 24 MiB block allocated and freed (glibc's own threshold rises to its size), then a 12 MiB block written and
# freed: prints whether the threshold was held, the heap's free MiB and how much of the 12 MiB left with the free.
LARGE_PROBE = LIBC + _applied_if("held", "map_large_blocks") + BLOCK_12_MIB + """
first = libc.malloc(24 << 20)
ctypes.memset(first, 1, 24 << 20)
libc.free(ctypes.c_void_p(first))
free_and_report(written_12_mib())
"""


@pytest.mark.parametrize("held", [True, False])
@needs_glibc
def test_blocks_of_8_mib_and_up_go_back_to_the_kernel_when_the_threshold_is_held(held):
    """``host_memory=balanced`` (posttrain.host.allocator.map_large_blocks): after a larger block came and went,
    a 12 MiB block still gets a mapping of its own, and its pages leave with its free; at glibc's own
    threshold (the negative control) it comes from the heap and stays there, resident, as a hole."""
    applied, free_mib, returned_mib = _run_probe(LARGE_PROBE, "held" if held else "glibc")
    if held:
        assert applied == "True" and int(free_mib) < 8 and int(returned_mib) >= 11
    else:
        assert applied == "False" and int(free_mib) >= 12 and int(returned_mib) < 2


@needs_glibc
def test_holding_the_threshold_leaves_a_users_allocator_setting_alone():
    out = _run_probe(_applied_if("held", "map_large_blocks"), "held", MALLOC_MMAP_THRESHOLD_="131072")
    assert out == ["False"]


# Blocks below the threshold (4 MiB each, 64 MiB in all) allocated at the heap's top, written and freed; prints
# the heap's free MiB and how much of the 64 MiB left the process's resident set with the frees.
TOP_PROBE = LIBC + """
import sys
from posttrain.host.resident import current_resident_bytes
if sys.argv[1] == 'held':
    from posttrain.host.allocator import map_large_blocks
    assert map_large_blocks()
else:  # the threshold alone, as map_large_blocks set it before: glibc's trim threshold stays at 128 KiB
    assert libc.mallopt(-3, 8 << 20)
blocks = [libc.malloc(4 << 20) for _ in range(16)]
for block in blocks:
    ctypes.memset(block, 1, 4 << 20)
before = current_resident_bytes() >> 20
for block in reversed(blocks):
    libc.free(ctypes.c_void_p(block))
print(libc.mallinfo2().fordblks >> 20, before - (current_resident_bytes() >> 20))
"""


@pytest.mark.parametrize("held", [True, False])
@needs_glibc
def test_holding_the_threshold_keeps_the_heaps_top_for_reuse(held):
    """Setting glibc's mmap threshold switches off its dynamic trim threshold too (128 KiB from then on):
    each free at the heap's top handed its pages back, and the next micro-batch faulted them in again.
    `map_large_blocks` keeps the top (freed pages stay resident, in the heap); the threshold alone (the
    negative control) returns them."""
    free_mib, returned_mib = map(int, _run_probe(TOP_PROBE, "held" if held else "threshold"))
    if held:
        assert free_mib >= 64 and returned_mib < 4
    else:
        assert free_mib < 4 and returned_mib >= 60


# Under map_large_blocks, a 12 MiB block allocated inside heap_allocations (or outside it: the negative control)
# and freed after it: prints the heap's free MiB and the MiB that left the resident set with the free.
HEAP_PROBE = LIBC + BLOCK_12_MIB + """
import contextlib, sys
from posttrain.host.allocator import heap_allocations, map_large_blocks
assert map_large_blocks()
with heap_allocations() if sys.argv[1] == 'heap' else contextlib.nullcontext():
    block = written_12_mib()
free_and_report(block)
"""


@pytest.mark.parametrize("heap", [True, False])
@needs_glibc
def test_a_large_block_comes_from_the_heap_inside_heap_allocations(heap):
    """The update's phase under ``host_memory=balanced`` (posttrain.distributed.placement): a block above the threshold
    comes from the heap and its freed pages stay there for the next micro-batch; outside, it is mapped and its
    pages leave with its free (the negative control)."""
    free_mib, returned_mib = map(int, _run_probe(HEAP_PROBE, "heap" if heap else "mapped"))
    if heap:
        assert free_mib >= 12 and returned_mib < 2
    else:
        assert free_mib < 8 and returned_mib >= 11
