"""Print fp32 and bf16 matmul TFLOP/s on this machine and their ratio.

    python benchmarks/matmul_rate.py [--device cpu|cuda] [--min-time 0.5]

The trainer's benchmark imports ``measure_matmul_flops`` from here (re-exported from
``posttrain.models.perf``).
"""

from __future__ import annotations

import argparse

import torch

from posttrain.models.perf import MODEL_LIKE_SHAPES, measure_matmul_flops

__all__ = ["measure_matmul_flops", "main"]


def main(argv: list[str] | None = None) -> dict[tuple[int, int, int], tuple[float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds per measurement")
    args = parser.parse_args(argv)
    print(f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__}")
    print(f"{'shape (m,k,n)':>20} {'fp32 TFLOP/s':>13} {'bf16 TFLOP/s':>13} {'bf16/fp32':>10}")
    results = {}
    for shape in MODEL_LIKE_SHAPES:
        fp32 = measure_matmul_flops("fp32", shape, args.device, args.min_time) / 1e12
        bf16 = measure_matmul_flops("bf16", shape, args.device, args.min_time) / 1e12
        results[shape] = (fp32, bf16)
        print(f"{str(shape):>20} {fp32:13.3f} {bf16:13.3f} {bf16 / fp32:10.2f}")
    return results


if __name__ == "__main__":
    main()
