"""fp32 decoding with each linear layer's weight packed once for the rows being decoded (MKL).

A decoding step multiplies a few rows (``prompts x n``) by every weight. For so few rows a plain
fp32 GEMM spends much of its time re-packing the weight into the kernel's panel layout at every
call: the whole weight is read and written again for a handful of output rows. MKL can pack a
weight once for a given row count (``cblas_sgemm_pack``) and then multiply packed panels only.
Measured on SmolLM2-135M's shapes at 20 rows, 2 cores of an AMX Xeon (fp32): 576->1536 0.30 ->
0.18 ms, 1536->576 0.39 -> 0.16 ms, the 49152-token head 15.7 -> 11.7 ms.

``packed_linears(model)`` is a ``with`` block for decoding: inside it every ``nn.Linear`` of the
model with a float32 weight multiplies with a packed copy of its weight, packed (again) whenever
the number of rows changes (rows leave the decoding batch when they finish). Results equal
``F.linear``'s for more than one row (the same kernel on the same panels); with one row, or a row
count other than the packed one, the layer falls back to ``F.linear`` itself. Outside the block
nothing changes, and nothing is packed where it cannot help: torch without MKL (ARM builds), a
weight that is not float32 (bf16 runs), autocast enabled, or autograd recording.

The packed copies cost about the weights' size while the block lasts (freed at its end); packing
the 135M weights takes ~50 ms, paid once per row count.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

__all__ = ["mkl_packing_available", "packed_linears"]


def mkl_packing_available() -> bool:
    """True where this torch build has MKL's packed fp32 GEMM (x86 builds; not ARM or CUDA-only)."""
    return bool(getattr(torch._C, "has_mkl", False)) and hasattr(torch.ops.mkl, "_mkl_linear")


class _Packed:
    """One linear layer's weight packed for ``rows`` rows (``None`` until the first call)."""

    __slots__ = ("rows", "weight")

    def __init__(self):
        self.rows, self.weight = 0, None

    def forward(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        usable = (rows > 1 and x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()
                  and not torch.is_autocast_enabled("cpu"))
        if not usable:
            return nn.functional.linear(x, layer.weight, layer.bias)
        if rows != self.rows:
            self.weight = torch.ops.mkl._mkl_reorder_linear_weight(layer.weight.detach(), rows)
            self.rows = rows
        out = torch.ops.mkl._mkl_linear(x.reshape(rows, x.shape[-1]), self.weight, layer.weight.detach(),
                                        layer.bias, rows)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _packable(weight: torch.Tensor) -> bool:
    """A plain fp32 CPU tensor (not a sharded DTensor or a tensor subclass)."""
    return type(weight.detach()) is torch.Tensor and weight.dtype == torch.float32 and weight.device.type == "cpu"


@contextlib.contextmanager
def packed_linears(model: nn.Module) -> Iterator[None]:
    """Inside the block, the model's fp32 ``nn.Linear`` layers multiply with MKL-packed weights (see module doc)."""
    layers = [m for m in model.modules() if type(m) is nn.Linear and _packable(m.weight)] if mkl_packing_available() else []
    originals = {}
    try:
        for layer in layers:
            packed = _Packed()
            originals[layer] = layer.__dict__.get("forward")
            layer.forward = lambda x, _layer=layer, _packed=packed: _packed.forward(_layer, x)
        yield
    finally:
        for layer, original in originals.items():
            if original is None:
                del layer.forward
            else:
                layer.forward = original
