"""Measure the machine's matmul rate, the yardstick for a step's tokens/s (DESIGN.md, performance).

A step costs about ``2 * params * tokens`` FLOPs per forward and ``6 * params * tokens`` per
training pass; dividing by :func:`measure_matmul_flops` gives the best time the hardware allows.
"""

from __future__ import annotations

import time

import torch

from posttrain.models.loading import parse_dtype

__all__ = ["measure_matmul_flops", "MODEL_LIKE_SHAPES"]

MODEL_LIKE_SHAPES: tuple[tuple[int, int, int], ...] = (
    (2048, 2048, 2048),   # square reference
    (1024, 576, 1536),    # SmolLM2-135M MLP up-projection on 1024 tokens
    (1024, 1536, 576),    # its down-projection
    (1024, 576, 576),     # attention projection
)
"""``(m, k, n)`` shapes: ``[m, k] @ [k, n]``."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_flops(
    dtype: str | torch.dtype = "fp32",
    shape: tuple[int, int, int] = (2048, 2048, 2048),
    device: str | torch.device = "cpu",
    min_time_s: float = 0.3,
) -> float:
    """Sustained FLOP/s of ``[m, k] @ [k, n]`` in ``dtype`` on ``device`` (``2*m*k*n`` per product).

    Warms up once, then repeats until ``min_time_s`` has passed; returns FLOP/s (not TFLOP/s).
    """
    device = torch.device(device)
    dt = parse_dtype(dtype)
    m, k, n = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(device=device, dtype=dt)
    b = torch.randn(k, n, generator=gen).to(device=device, dtype=dt)
    torch.matmul(a, b)
    _sync(device)
    reps, start = 0, time.perf_counter()
    while True:
        torch.matmul(a, b)
        reps += 1
        _sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= min_time_s:
            return 2.0 * m * k * n * reps / elapsed
