"""Masked reductions shared by the advantage estimators and the losses.

Semantics follow verl 0.9 (`verl/utils/torch_functional.py`) exactly, including the `1e-8`
added to the mask count in `masked_mean` and the `1e-8` inside the whitening rsqrt, so numbers
agree with verl at float32 precision. Masks may be bool, integer or float tensors of 0/1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

_MISSING = object()


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is non-zero; NaN/inf at masked positions cannot leak in.

    values, mask: same shape, e.g. `[batch, response_len]`. Returns the sum reduced over `axis`
    (all elements when None).
    """
    valid = torch.where(mask.bool(), values, 0.0)
    return (valid * mask).sum(axis=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Mean over masked elements: `masked_sum / (mask.sum() + 1e-8)` (an empty mask gives 0)."""
    return masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked elements (a scalar); Bessel-corrected when `unbiased`.

    Raises ValueError when `unbiased` and the mask holds fewer than two elements, as verl does.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count == 0:
            raise ValueError("masked_var: the mask selects no element.")
        if count == 1:
            raise ValueError("masked_var: the mask selects one element; the unbiased variance divides by zero.")
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """`(values - mean) / sqrt(var + 1e-8)` with mean and unbiased var taken over the mask.

    Every position is transformed (masked ones too); callers multiply by the mask when they need
    zeros there. With `shift_mean=False` the mean is added back after scaling.
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor) -> torch.Tensor:
    """Element-wise clamp of `x` into `[tensor_min, tensor_max]` with tensor bounds."""
    return torch.max(torch.min(x, tensor_max), tensor_min)


def config_value(config: Any, name: str, default: Any = _MISSING) -> Any:
    """Read `name` from a dataclass/namespace (attribute) or a mapping (key).

    A default is only for keys verl itself treats as optional; without one a missing key raises
    KeyError naming it, so a misspelled key fails loudly.
    """
    if config is None:
        found = _MISSING
    elif isinstance(config, Mapping):
        found = config.get(name, _MISSING)
    else:
        found = getattr(config, name, _MISSING)
    if found is not _MISSING:
        return found
    if default is _MISSING:
        raise KeyError(f"config has no field {name!r} (type {type(config).__name__})")
    return default
