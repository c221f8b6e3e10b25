"""posttrain.host.resident: resident memory now, at its peak, and per phase, against allocations of known size."""

from __future__ import annotations

import ctypes
import mmap
import sys

import pytest
import torch

from posttrain.host.resident import GB, PhasePeaks, current_resident_bytes, peak_resident_bytes, reset_peak
from posttrain.trainer.metrics import StageTimer

MB = 2**20
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def touched_mapping(size: int) -> mmap.mmap:
    """``size`` bytes of anonymous memory, every page written (resident), outside malloc: freeing it
    returns it to the kernel whatever the allocator keeps (posttrain.host.allocator keeps freed blocks)."""
    block = mmap.mmap(-1, size)
    ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(block)), 1, size)
    return block


@linux
def test_a_tensor_raises_the_current_reading_by_its_size():
    before = current_resident_bytes()
    tensor = torch.ones(64 * MB, dtype=torch.float32)  # 256 MiB, written by ones()
    grown = current_resident_bytes() - before
    assert 0.95 * tensor.nbytes <= grown <= tensor.nbytes + 32 * MB
    assert peak_resident_bytes() >= before + tensor.nbytes * 0.95


@linux
def test_reading_untouched_memory_does_not_count():
    """Negative control: reserved but never written pages are not resident."""
    before = current_resident_bytes()
    block = mmap.mmap(-1, 256 * MB)
    assert current_resident_bytes() - before < 16 * MB
    block.close()


@linux
def test_the_peak_survives_a_free_until_reset():
    base = current_resident_bytes()
    block = touched_mapping(200 * MB)
    block.close()
    assert current_resident_bytes() < base + 50 * MB  # given back to the kernel
    assert peak_resident_bytes() >= base + 190 * MB
    if not reset_peak():
        pytest.skip("this kernel does not allow resetting the high-water mark")
    assert peak_resident_bytes() < base + 50 * MB


@linux
def test_phase_peaks_separate_a_large_phase_from_a_small_one():
    peaks = PhasePeaks()
    if not peaks.resettable:
        pytest.skip("this kernel does not allow resetting the high-water mark")
    base = current_resident_bytes()
    with peaks("step"):
        with peaks("large"):
            touched_mapping(300 * MB).close()  # held only inside the phase
        with peaks("small"):
            touched_mapping(20 * MB).close()
    metrics = peaks.take_metrics()
    large, small = metrics["memory/resident_gb/large"] * GB, metrics["memory/resident_gb/small"] * GB
    assert large >= base + 290 * MB
    assert small < base + 80 * MB  # negative control: the large phase's peak did not leak into it
    assert metrics["memory/resident_gb/step"] * GB >= large  # the enclosing phase saw it
    assert metrics["memory/peak_resident_gb"] * GB >= large
    # the next step starts with no phases but keeps the run's peak
    again = peaks.take_metrics()
    assert set(again) == {"memory/peak_resident_gb"}
    assert again["memory/peak_resident_gb"] >= metrics["memory/resident_gb/large"]


@linux
def test_the_run_peak_includes_what_came_before_the_tracker():
    """Loading the models happens before the trainer builds its tracker: their peak must not be lost."""
    reset_peak()
    base = current_resident_bytes()
    touched_mapping(300 * MB).close()
    peaks = PhasePeaks()
    assert peaks.take_metrics()["memory/peak_resident_gb"] * GB >= base + 290 * MB


@linux
def test_stage_timer_reports_seconds_and_memory_of_the_same_stage():
    timer = StageTimer(PhasePeaks())
    with timer("gen"):
        block = touched_mapping(100 * MB)
        block.close()
    metrics = timer.metrics()
    assert metrics["timing_s/gen"] > 0
    assert metrics["memory/resident_gb/gen"] * GB >= current_resident_bytes() + 90 * MB
    assert "memory/resident_gb/gen" not in StageTimer().metrics()  # without a tracker, timing only
