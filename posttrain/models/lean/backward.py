"""Layers that keep less for backward under bf16 autocast: the same function, fewer saved tensors.

Autocast rounds a float32 model's matmul inputs to bf16 as they are used, and autograd keeps what each
op needs for backward. For a Llama-style decoder layer that is more than the layer needs:

- every ``nn.Linear`` keeps the bf16 cast of its weight (``grad_input = grad_output @ weight``): one bf16
  copy of the model per micro-batch in flight, 0.27 GB for SmolLM2-135M. `RecastLinear` keeps the
  float32 weight instead, which is in memory anyway, and casts it again in backward;
- an RMSNorm keeps its float32 output, and each projection that reads it keeps its own bf16 cast of it
  (q, k and v: three). `LeanRMSNorm` keeps only its input and the per-row scale, and hands out its
  output already in bf16, so the projections share one cast;
- the SwiGLU product ``silu(gate) * up`` keeps ``gate``, ``silu(gate)`` and ``up``, and ``down_proj`` keeps
  the product (its input): four bf16 ``[tokens, intermediate]`` tensors. `LeanSwiGLU` keeps ``gate`` and
  ``up`` and the float32 down weight, and recomputes the activation and the product in backward; with a
  ``down_proj`` of another class (a LoRA wrapper) it keeps the product too (three).

The forward values are the same bits (the products read the same bf16 operands); the gradients are the
same up to where bf16 rounding lands: the norm's output gradient is summed over its readers in bf16
rather than float32 (as a bf16 model always does). `tests/models/test_lean_backward.py` compares them
with autocast's own layers and counts what autograd keeps. Without gradients, outside bf16 autocast, or
on weights that are not float32 (a frozen bf16 copy), each layer runs its original forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LeanRMSNorm", "LeanSwiGLU", "RecastLinear", "keep_less_for_backward", "low_dtype"]

RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
"""RMSNorm classes computing ``weight * (x * rsqrt(mean(x^2) + eps))`` (Gemma's ``1 + weight`` is not one)."""
LAYER_NORMS_READ_BY_LINEARS = ("input_layernorm", "post_attention_layernorm")
"""The norms whose output only projections read (so a bf16 output is what they would cast it to): not
the final norm, nor Qwen3's q/k norms, whose outputs are rotated in float32."""
SWIGLU_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")
"""MLP classes computing ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""


def low_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype when this forward should keep less (module docstring), else None."""
    device = x.device.type
    if torch.is_grad_enabled() and torch.is_autocast_enabled(device) and weight.dtype == torch.float32:
        return torch.get_autocast_dtype(device)
    return None


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
        grad_x = _recast_input_grad(grad_out, weight, ctx.input_dtype) if ctx.needs_input_grad[0] else None
        grad_weight, grad_bias = _weight_and_bias_grads(grad_out, x_low, weight, ctx.bias_dtype,
                                                        ctx.needs_input_grad[1:3])
        return grad_x, grad_weight, grad_bias, None


def _recast_input_grad(grad_out: torch.Tensor, weight: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
    """``grad_out @ weight`` with the float32 weight cast again to the gradient's dtype (bf16), as forward did."""
    return (grad_out @ weight.to(grad_out.dtype)).to(input_dtype)


def _weight_and_bias_grads(grad_out: torch.Tensor, x_low: torch.Tensor, weight: torch.Tensor,
                           bias_dtype: torch.dtype | None, needed: tuple[bool, bool]):
    """A linear layer's weight and bias gradients (None where not ``needed``) from its low-precision input."""
    rows = grad_out.reshape(-1, grad_out.shape[-1])
    grad_weight = grad_bias = None
    if needed[0]:
        grad_weight = (rows.t() @ x_low.reshape(-1, x_low.shape[-1]).to(rows.dtype)).to(weight.dtype)
    if needed[1]:
        grad_bias = rows.sum(0).to(bias_dtype)
    return grad_weight, grad_bias


class RecastLinear(nn.Linear):
    """An ``nn.Linear`` whose autocast forward keeps its float32 weight, not a cast, for backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = low_dtype(x, self.weight)
        if dtype is None:
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):  # the casts are ours: autocast would cache another copy
            return _LinearRecastInBackward.apply(x, self.weight, self.bias, dtype)


class _RMSNormToLow(torch.autograd.Function):
    """RMSNorm of a float32 ``x``, output in ``dtype``; saves the input and the per-row scale."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype):
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, scale)
        return (weight * (x * scale)).to(dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, scale = ctx.saved_tensors
        grad_out = grad_out.float()
        normed = x * scale
        grad_weight = (grad_out * normed).reshape(-1, x.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        grad_normed = grad_out * weight
        grad_x = scale * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        return grad_x, grad_weight, None, None


class LeanRMSNorm(nn.Module):
    """An RMSNorm (`RMS_NORMS`) whose autocast training forward returns bf16 and keeps only its input."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = low_dtype(hidden_states, self.weight)
        if dtype is None or hidden_states.dtype != torch.float32:
            return self._original_forward(hidden_states)
        with torch.autocast(hidden_states.device.type, enabled=False):
            return _RMSNormToLow.apply(hidden_states, self.weight, self.variance_epsilon, dtype)


class _SiluTimes(torch.autograd.Function):
    """``silu(gate) * up``; saves ``gate`` and ``up``, recomputes ``silu(gate)`` in backward."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        return _silu_times_grads(grad_out, gate, up, F.silu(gate))


def _silu_times_grads(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, silu_gate: torch.Tensor):
    """The gradients of ``silu(gate) * up`` for ``gate`` and ``up``, given ``silu(gate)`` recomputed."""
    grad_up = grad_out * silu_gate
    grad_gate = torch.ops.aten.silu_backward(grad_out * up, gate)
    return grad_gate, grad_up


class _SiluTimesDown(torch.autograd.Function):
    """``down(silu(gate) * up)`` with the down weight cast to ``dtype``; saves ``gate``, ``up`` and the float32
    weight itself, not the product: backward recomputes it for the weight gradient. Forward and every
    gradient are bitwise those of `_SiluTimes` followed by `RecastLinear`: the same ops on the same operands
    (the recomputed product is the forward's bits), under the same autocast states."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                dtype: torch.dtype):
        ctx.save_for_backward(gate, up, weight)
        ctx.dtype, ctx.bias_dtype = dtype, None if bias is None else bias.dtype
        product = F.silu(gate) * up  # under the caller's autocast, as `_SiluTimes`
        ctx.product_dtype = product.dtype
        with torch.autocast(gate.device.type, enabled=False):  # the casts are ours, as in `RecastLinear`
            return F.linear(product.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        silu_gate = F.silu(gate)  # once, for the product and for up's gradient
        grad_weight, grad_bias = _weight_and_bias_grads(grad_out, (silu_gate * up).to(ctx.dtype), weight,
                                                        ctx.bias_dtype, ctx.needs_input_grad[2:4])
        grad_product = _recast_input_grad(grad_out, weight, ctx.product_dtype)
        grad_gate, grad_up = _silu_times_grads(grad_product, gate, up, silu_gate)
        return grad_gate, grad_up, grad_weight, grad_bias, None


_FUSABLE_DOWN_PROJS = (RecastLinear, nn.Linear)
"""``down_proj`` classes (exactly: a LoRA wrapper or any subclass keeps its own forward) whose product
`_SiluTimesDown` computes itself."""


def _fusable(down: nn.Module) -> bool:
    """``down`` is a plain linear layer that nothing observes: its forward may be skipped (hooks would not run)."""
    hooks = nn.modules.module
    hooked = (down._forward_hooks or down._forward_pre_hooks or hooks._global_forward_hooks
              or hooks._global_forward_pre_hooks)
    return type(down) in _FUSABLE_DOWN_PROJS and not hooked


class LeanSwiGLU(nn.Module):
    """A SwiGLU MLP (`SWIGLU_MLPS`) whose autocast training forward keeps ``gate`` and ``up`` (and the down
    weight, a parameter) only; with an unfusable ``down_proj`` that also keeps its input, the product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if low_dtype(x, self.gate_proj.weight) is None:
            return self._original_forward(x)
        gate, up = self.gate_proj(x), self.up_proj(x)
        down = self.down_proj
        dtype = low_dtype(x, down.weight) if _fusable(down) else None
        if dtype is None:
            return down(_SiluTimes.apply(gate, up))
        return _SiluTimesDown.apply(gate, up, down.weight, down.bias, dtype)


def _is_silu(act: nn.Module | None) -> bool:
    """torch's SiLU or transformers' (``ACT2FN["silu"]``)."""
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _lean_class(cls: type, lean: type) -> type:
    """``cls`` with ``lean``'s forward (``cls``'s own kept as ``_original_forward``): a subclass, so
    ``isinstance``, the parameters and the state dict are unchanged."""
    return type(f"Lean{cls.__name__}", (cls,), {"forward": lean.forward, "_original_forward": cls.forward,
                                                "__module__": __name__})


_LEAN_CLASSES: dict[type, type] = {}


def keep_less_for_backward(module: nn.Module) -> dict[str, int]:
    """Every plain ``nn.Linear``, decoder-layer RMSNorm and SwiGLU MLP inside ``module`` switched in place to the
    lean forward of the module docstring; returns how many of each were switched."""
    counts = {"linear": 0, "rms_norm": 0, "swiglu": 0}
    for name, layer in module.named_modules():
        cls = type(layer)
        if cls is nn.Linear:
            layer.__class__ = RecastLinear
            counts["linear"] += 1
        elif cls.__name__ in RMS_NORMS and name.rsplit(".", 1)[-1] in LAYER_NORMS_READ_BY_LINEARS:
            layer.__class__ = _LEAN_CLASSES.setdefault(cls, _lean_class(cls, LeanRMSNorm))
            counts["rms_norm"] += 1
        elif cls.__name__ in SWIGLU_MLPS and _is_silu(getattr(layer, "act_fn", None)):
            layer.__class__ = _LEAN_CLASSES.setdefault(cls, _lean_class(cls, LeanSwiGLU))
            counts["swiglu"] += 1
    return counts
