"""AdamW (float32 or 8-bit moments) and the learning-rate schedules of verl (``verl/utils/torch_functional.py``).

``optim.optimizer`` names the optimizer in verl's spelling (``AdamW``) or TRL's ``optim`` spelling
(``adamw_torch``, ``adamw_torch_fused``, ``adamw_8bit``); ``auto`` is the placement's choice (the
run's memory plan, `posttrain.host.memory_plan`), plain AdamW where nothing chose.

The schedule advances once per *training step* (one ``update_policy``/``update_critic`` call), not
per optimizer step, as in verl's workers. Warm-up steps: ``optim.lr_warmup_steps`` when >= 0,
else ``int(optim.lr_warmup_steps_ratio * optim.total_training_steps)``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = [
    "OPTIMIZER_NAMES",
    "build_optimizer",
    "optimizer_kind",
    "build_lr_scheduler",
    "trainable_parameters",
    "constant_schedule_with_warmup",
    "cosine_schedule_with_warmup",
    "scheduler_type",
]


OWN_8BIT = "posttrain_adamw_8bit"
"""The name of posttrain's own 8-bit AdamW (`posttrain.optim.adamw8bit.AdamW8bit`: block-wise moments in its own
format, 2 bytes a parameter instead of 8, updated in C); ``auto`` picks it on a one-process CPU run."""

OPTIMIZER_NAMES = {"auto": "auto", "adamw": "adamw", "adamw_torch": "adamw", "adamw_torch_fused": "adamw",
                   OWN_8BIT: "adamw_8bit", "adamw8bit": "adamw_8bit"}
"""Accepted spellings of ``optim.optimizer`` (lower-cased) -> ``adamw`` (float32 moments), ``adamw_8bit``
(posttrain's own 8-bit AdamW, `OWN_8BIT`) or ``auto`` (the placement decides)."""

LIBRARY_OPTIMIZERS = {"adamw_8bit": ("bitsandbytes.optim", "AdamW8bit"),
                      "adamw_bnb_8bit": ("bitsandbytes.optim", "AdamW8bit"),
                      "paged_adamw_8bit": ("bitsandbytes.optim", "PagedAdamW8bit"),
                      "adamw_torch_8bit": ("torchao.optim", "AdamW8bit"),
                      "adamw_torch_4bit": ("torchao.optim", "AdamW4bit")}
"""transformers' and TRL's names of other libraries' optimizers (``OptimizerNames``): each means that library's
class, as it does there."""


OWN_IMPLS = ("torch.optim", "posttrain.optim")
"""``optim.optimizer_impl`` values whose AdamW names posttrain resolves itself (float32 AdamW from torch.optim,
its own 8-bit AdamW, ``auto``); any other module is imported and its class named ``optim.optimizer`` built."""


def optimizer_kind(optim: Any, key: str = "optim.optimizer") -> str:
    """``optim.optimizer`` as ``auto``, ``adamw``, ``adamw_8bit``, or ``external`` (a class of another module:
    ``optim.optimizer_impl``, verl's key, or a torch.optim class other than AdamW); ``key`` names it in the error."""
    name = str(getattr(optim, "optimizer", "auto") or "auto")
    impl = str(getattr(optim, "optimizer_impl", "torch.optim") or "torch.optim")
    if impl not in OWN_IMPLS or name.lower() in LIBRARY_OPTIMIZERS:
        return "external"
    kind = OPTIMIZER_NAMES.get(name.lower())
    if kind is None and impl == "torch.optim" and isinstance(getattr(torch.optim, name, None), type):
        return "external"  # verl: getattr(torch.optim, optimizer), e.g. SGD or Adam
    if kind is None:
        raise ValueError(f"{key}={name!r} is not an optimizer posttrain knows: AdamW (verl's name; also adamw_torch, "
                         f"adamw_torch_fused), {OWN_8BIT} (posttrain's 8-bit moments), auto, a library's name as "
                         f"transformers has it ({', '.join(LIBRARY_OPTIMIZERS)}), a torch.optim class, or a class of "
                         f"another module named by optim.optimizer_impl (e.g. torchao.optim)")
    return kind


def external_optimizer_class(optim: Any, key: str = "optim") -> type:
    """The class ``optim.optimizer`` of the module ``optim.optimizer_impl`` (verl's `build_optimizer` rule)."""
    import importlib

    impl = str(getattr(optim, "optimizer_impl", "torch.optim") or "torch.optim")
    name = str(optim.optimizer)
    if name.lower() in LIBRARY_OPTIMIZERS:
        impl, name = LIBRARY_OPTIMIZERS[name.lower()]
    try:
        module = importlib.import_module(impl)
    except ImportError as err:
        library = impl.split(".")[0]
        raise ValueError(f"{key}.optimizer={optim.optimizer!r} (optimizer_impl={impl}) needs {library}, which cannot be "
                         f"imported ({err}); install it, or use posttrain's own 8-bit AdamW: {key}.optimizer={OWN_8BIT} "
                         "(auto picks it on a one-process CPU run)") from None
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ValueError(f"{key}.optimizer={name!r} is not a class of {impl}")
    return cls


def _override_kwargs(optim: Any) -> dict[str, Any]:
    """``optim.override_optimizer_config`` (verl's key): extra constructor arguments, or none."""
    extra = getattr(optim, "override_optimizer_config", None) or {}
    return dict(extra)


def build_optimizer(params: Iterable[torch.nn.Parameter], optim: Any,
                    make: Callable[..., torch.optim.Optimizer] | None = None,
                    kind: str | None = None) -> torch.optim.Optimizer:
    """AdamW(lr, betas, weight_decay) from an ``optim`` config section.

    ``kind``: ``adamw`` or ``adamw_8bit`` (default: `optimizer_kind` of ``optim``, ``auto`` read as
    ``adamw``). AdamW gets the fused kernel when every parameter is a floating tensor on CPU or CUDA
    (several times faster than the default ``foreach`` path on CPU: benchmarks/README.md); same update.
    ``make``: the AdamW (or, for ``adamw_8bit``, `AdamW8bit`) class to build, when the placement keeps the
    moments elsewhere (it hands out the optimizer: `posttrain.workers.prepare.Placement.optimizer`).
    """
    betas = tuple(float(b) for b in optim.betas)
    if len(betas) != 2:
        raise ValueError(f"optim.betas must hold two numbers, got {optim.betas!r}")
    params = list(params)
    kwargs = dict(lr=float(optim.lr), betas=betas, weight_decay=float(optim.weight_decay))
    kwargs.update(_override_kwargs(optim))
    kind = kind or optimizer_kind(optim)
    if kind == "external":
        adam_like = any(word in str(optim.optimizer).lower() for word in ("adam", "ademamix"))
        if not adam_like and "betas" not in _override_kwargs(optim):
            del kwargs["betas"]  # verl's rule: betas only for Adam-like classes (SGD takes none)
        return external_optimizer_class(optim)(params, **kwargs)
    if kind == "adamw_8bit":
        from posttrain.optim.adamw8bit import AdamW8bit  # a torch optimizer; none of host's process levers
        return (make or AdamW8bit)(params, **kwargs)
    make = make or torch.optim.AdamW
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    if tensors and all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in tensors):
        try:
            return make(params, **{"fused": True, **kwargs})
        except (RuntimeError, TypeError, ValueError):  # an older torch or an unsupported dtype/device
            pass
    return make(params, **kwargs)


def constant_schedule_with_warmup(num_warmup_steps: int):
    """lr factor: linear 0 -> 1 over the warm-up steps, then 1."""

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return min(1.0, step / max(1, num_warmup_steps))
        return 1.0

    return factor


def cosine_schedule_with_warmup(num_warmup_steps: int, num_training_steps: int, min_lr_ratio: float = 0.0,
                                num_cycles: float = 0.5):
    """lr factor: linear warm-up, then cosine from 1 to ``min_lr_ratio`` (``num_cycles=0.5``: half a wave)."""
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    coef, intercept = (1 - min_lr_ratio) * 0.5, (1 + min_lr_ratio) * 0.5

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
        return max(min_lr_ratio, math.cos(math.pi * num_cycles * 2.0 * progress) * coef + intercept)

    return factor


def scheduler_type(optim: Any) -> str:
    """``optim.warmup_style`` (verl's deprecated name) when set, else ``optim.lr_scheduler_type``."""
    style = getattr(optim, "warmup_style", None)
    return style if style else getattr(optim, "lr_scheduler_type", "constant")


def warmup_steps(optim: Any) -> int:
    """``lr_warmup_steps`` when >= 0, else ``int(lr_warmup_steps_ratio * total_training_steps)``."""
    steps = int(optim.lr_warmup_steps)
    if steps >= 0:
        return steps
    total = int(optim.total_training_steps)
    return int(float(optim.lr_warmup_steps_ratio) * total) if total > 0 else 0


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim: Any) -> LambdaLR:
    """verl's constant or cosine schedule with warm-up, from an ``optim`` config section."""
    kind = scheduler_type(optim)
    warm = warmup_steps(optim)
    if kind == "constant":
        return LambdaLR(optimizer, constant_schedule_with_warmup(warm))
    if kind == "cosine":
        total = int(optim.total_training_steps)
        if total <= 0:
            raise ValueError("optim.total_training_steps must be set (> 0) for the cosine lr schedule")
        factor = cosine_schedule_with_warmup(warm, total, float(optim.min_lr_ratio), float(optim.num_cycles))
        return LambdaLR(optimizer, factor)
    raise ValueError(f"unknown lr schedule {kind!r} (optim.lr_scheduler_type / optim.warmup_style): constant, cosine")


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters an optimizer updates: those with ``requires_grad`` (all, in full fine-tuning)."""
    return [p for p in module.parameters() if p.requires_grad]
