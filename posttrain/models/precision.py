"""Mixed precision: fp32 master weights, bf16 autocast compute.

``fsdp_config.mixed_precision.param_dtype='bf16'`` means forward/backward matmuls run in bfloat16
under ``torch.autocast`` (CPU: AVX512-BF16/AMX kernels; CUDA: tensor cores) while parameters,
gradients and optimizer state stay float32. ``'fp32'`` disables autocast.
"""

from __future__ import annotations

import contextlib

import torch

from posttrain.models.loading import parse_dtype

__all__ = ["autocast_context", "default_device"]


def default_device() -> torch.device:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast_context(device: str | torch.device, param_dtype: str | torch.dtype | None):
    """``torch.autocast(device_type, dtype)`` for a 16-bit ``param_dtype``; a no-op for fp32/None."""
    if param_dtype is None:
        return contextlib.nullcontext()
    dtype = parse_dtype(param_dtype)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)
