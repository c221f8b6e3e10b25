"""Linear layers that keep no 16-bit copy of their weights for backward.

Under bf16 autocast every ``nn.Linear`` multiplies by a bf16 cast of its float32 weight, and autograd
keeps that cast until backward needs it (``grad_input = grad_output @ weight``): one bf16 copy of every
weight per micro-batch in flight, 0.27 GB for SmolLM2-135M (autocast's cast cache holds the same
tensors). `recast_weights_in_backward` makes a module's linear layers keep a reference to the float32
weight instead, which is in memory anyway, and cast it again in backward. The cost is one more cast of
each weight per micro-batch, small beside the matmuls it feeds; the products are the same bf16 matmuls
(`tests/models/test_recast_linear.py` compares gradients with autocast's and counts what autograd keeps).

Outside autocast, in float32 or on weights that are not float32 (a frozen bf16 copy), a layer runs
``nn.Linear``'s own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RecastLinear", "recast_weights_in_backward"]


class _LinearRecastInBackward(torch.autograd.Function):
    """``x @ weight.T + bias`` in ``dtype``; saves the input's ``dtype`` cast and the weight itself."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        x_low = x.to(dtype)
        ctx.save_for_backward(x_low, weight)
        ctx.input_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype
        return F.linear(x_low, weight.to(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x_low, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_out @ weight.to(grad_out.dtype)).to(ctx.input_dtype)
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_weight = (rows.t() @ x_low.reshape(-1, x_low.shape[-1]).to(rows.dtype)).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias, None


class RecastLinear(nn.Linear):
    """An ``nn.Linear`` whose autocast forward keeps its float32 weight, not a cast, for backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if not (torch.is_autocast_enabled(device) and self.weight.dtype == torch.float32):
            return super().forward(x)
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):  # the casts are ours: autocast would cache another copy
            return _LinearRecastInBackward.apply(x, self.weight, self.bias, dtype)


def recast_weights_in_backward(module: nn.Module) -> int:
    """Every plain ``nn.Linear`` inside ``module`` turned into a `RecastLinear` in place (the same
    parameters, state dict and ``isinstance``); returns how many were changed."""
    changed = 0
    for layer in module.modules():
        if type(layer) is nn.Linear:
            layer.__class__ = RecastLinear
            changed += 1
    return changed
