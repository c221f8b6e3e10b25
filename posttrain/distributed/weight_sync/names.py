"""What the trainer sends and how a rollout worker loads it: `trainer_weights` (every weight, or the LoRA adapter
alone, under the names a Hugging Face module loads), `push_trainer_weights` (every trainer rank iterates, rank 0
sends), `load_weights` / `stage_weights` (names and shapes checked against the rollout worker's own module) and
`receive_into` (load, then push into a vLLM engine when there is one)."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from posttrain.distributed.weight_sync.transport import (DEFAULT_BUCKET_BYTES, FileWeightSync, NamedTensors,
                                                         WeightSyncError, WeightSyncGroup)

__all__ = ["load_weights", "push_trainer_weights", "receive_into", "stage_weights", "trainer_weights"]

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
"""Prefixes FSDP, activation checkpointing and torch.compile put before a module's own parameter names."""


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP2 DTensor shard is all-gathered (a collective on every trainer rank)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None or not t.is_floating_point() else t.to(dtype)


def _persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers that belong to the state dict (not e.g. rotary ``inv_freq``, which each side computes)."""
    seen: set[int] = set()
    for prefix, sub in module.named_modules():
        for name, buf in sub._buffers.items():
            if buf is None or name in sub._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            yield (f"{prefix}.{name}" if prefix else name), buf


def _has_lora(module: nn.Module) -> bool:
    import sys

    if "peft" not in sys.modules:
        return False
    from posttrain.models.lora import has_lora

    return has_lora(module)


def trainer_weights(module: nn.Module, lora_only: bool = False, *,
                    dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """What the trainer sends, one full tensor at a time, in ``named_parameters`` order.

    ``lora_only=False``: every parameter (tied twins once) and persistent buffer. For a LoRA model,
    the adapters merged into the weights they adapt (``W + scaling * B @ A``) under the base model's
    names: what a rollout model without LoRA holds. ``lora_only=True``: only the LoRA adapter
    matrices, under the injected model's names (``...q_proj.lora_A.default.weight``), for a rollout
    worker that holds its own LoRA-injected copy of the same base.

    FSDP2 parameters are gathered with ``full_tensor()`` when reached: every trainer rank must
    iterate this to the end (see :func:`push_trainer_weights`). ``dtype`` casts floating tensors
    (e.g. bf16 for a bf16 rollout engine: half the bytes).
    """
    lora = _has_lora(module)
    if lora_only:
        if not lora:
            raise WeightSyncError(f"trainer_weights(lora_only=True): {type(module).__name__} carries no LoRA adapters "
                                  "(actor_rollout_ref.model.lora_rank is 0?); send the full weights instead")
        for name, p in module.named_parameters():
            if ".lora_" in name:
                yield _clean(name), _cast(_full(p), dtype)
        return
    if lora:
        yield from _merged_unique(module, dtype)
    else:
        for name, p in module.named_parameters():
            yield _clean(name), _cast(_full(p), dtype)
    for name, buf in _persistent_buffers(module):
        yield _clean(name), _cast(buf.detach(), dtype)


def _merged_unique(module: nn.Module, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """`merged_named_tensors` without the tied twins (one name per shared parameter)."""
    from posttrain.models.lora import merged_named_tensors

    unique = {name for name, _ in module.named_parameters()}
    for (name, _), (merged_name, tensor) in zip(
            ((n, p) for n, p in module.named_parameters(remove_duplicate=False) if ".lora_" not in n),
            merged_named_tensors(module, dtype)):
        if name in unique:
            yield _clean(merged_name), tensor


def push_trainer_weights(group: WeightSyncGroup | FileWeightSync | None, module: nn.Module, version: int, *,
                         lora_only: bool = False, dtype: torch.dtype | None = None,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, float]:
    """Run on EVERY trainer rank: rank 0 (``group`` given) sends, the others (``group=None``) iterate
    :func:`trainer_weights` too, so that FSDP2's gathers (collectives of the trainer's own group)
    happen on all of them. Returns the send metrics on rank 0, ``{}`` elsewhere."""
    named = trainer_weights(module, lora_only, dtype=dtype)
    if group is None:
        for _ in named:
            pass
        return {}
    return group.send(named, version, bucket_bytes=bucket_bytes)


# --------------------------------------------------------------------------- what the rollout loads
def _load_targets(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every name a weight may arrive under: parameters (tied twins under each name) and buffers."""
    targets = {_clean(n): p for n, p in module.named_parameters(remove_duplicate=False)}
    targets.update({_clean(n): b for n, b in module.named_buffers(remove_duplicate=False)})
    return targets


def _required(module: nn.Module, lora_only: bool) -> dict[int, str]:
    """Tensors a complete transfer must fill, by identity (a tied pair counts once): the LoRA adapter
    matrices when ``lora_only``, else every parameter and persistent buffer."""
    if lora_only:
        return {id(p): _clean(n) for n, p in module.named_parameters() if ".lora_" in n}
    required = {id(p): _clean(n) for n, p in module.named_parameters()}
    required.update({id(b): _clean(n) for n, b in _persistent_buffers(module)})
    return required


def _unknown_name(name: str, tensor: torch.Tensor, module: nn.Module, targets: dict) -> str:
    hint = ""
    if _has_lora(module) and ".lora_" not in name:
        hint = ("; this module carries LoRA adapters: from a LoRA trainer receive the adapters alone "
                "(lora_only=True on both sides), or load merged weights into a model without LoRA")
    sample = ", ".join(list(targets)[:3])
    return (f"load_weights: {name!r} (shape {list(tensor.shape)}) is not a parameter or buffer of "
            f"{type(module).__name__} (it has {len(targets)} names, e.g. {sample}){hint}")


class _NameCheck:
    """The checks `load_weights` and `stage_weights` share: each name known, each shape the module's,
    nothing missing at the end (a tied pair counts once)."""

    def __init__(self, module: nn.Module, lora_only: bool, caller: str):
        self.module, self.lora_only, self.caller = module, lora_only, caller
        self.targets = _load_targets(module)
        self.required = _required(module, lora_only)
        self.filled: set[int] = set()

    def target(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The module's tensor that ``name`` fills; `WeightSyncError` naming it when it does not fit."""
        target = self.targets.get(name)
        if target is None:
            raise WeightSyncError(_unknown_name(name, tensor, self.module, self.targets))
        if self.lora_only and ".lora_" not in name:
            raise WeightSyncError(f"{self.caller}(lora_only=True): received the base weight {name!r}; the trainer "
                                  "sent full weights (send with lora_only=True too)")
        if tuple(target.shape) != tuple(tensor.shape):
            raise WeightSyncError(f"{self.caller}: {name!r} arrived with shape {list(tensor.shape)}, "
                                  f"{type(self.module).__name__} holds {list(target.shape)}")
        self.filled.add(id(target))
        return target

    def finish(self) -> None:
        missing = [name for key, name in self.required.items() if key not in self.filled]
        if missing:
            shape = list(self.targets[missing[0]].shape)
            only = ", LoRA adapters only" if self.lora_only else ""
            raise WeightSyncError(f"{self.caller}: {missing[0]!r} (shape {shape}) never arrived ({len(missing)} of "
                                  f"{len(self.required)} expected tensors missing{only})")


def load_weights(module: nn.Module, named: NamedTensors, *, lora_only: bool = False) -> int:
    """Copy ``named`` into ``module``'s parameters and buffers in place (dtype converted, device
    moved); returns how many tensors were copied.

    Checked as they arrive: an unknown name or a shape mismatch raises `WeightSyncError` naming it
    (tensors before it are already copied: the module must not be used after an error); at the end,
    one error names the first tensor that never arrived (``lora_only``: only adapter matrices are
    expected, and a base weight arriving is an error). A tied weight arrives under either name.
    """
    check = _NameCheck(module, lora_only, "load_weights")
    count = 0
    with torch.no_grad():
        for name, tensor in named:
            check.target(name, tensor).copy_(tensor)
            count += 1
    check.finish()
    return count


def stage_weights(module: nn.Module, named: NamedTensors, *, lora_only: bool = False) -> dict[str, torch.Tensor]:
    """``named`` as a dict, checked against ``module`` exactly as `load_weights` checks, nothing copied
    into the module: for a rollout worker that receives while it generates and loads the dict
    (``load_weights(module, staged.items())``) at its next task boundary. The tensors are the
    received ones (a `WeightSyncGroup` allocates a fresh buffer per bucket, so keeping them is safe)."""
    check = _NameCheck(module, lora_only, "stage_weights")
    staged = {}
    for name, tensor in named:
        check.target(name, tensor)
        staged[name] = tensor
    check.finish()
    return staged


def receive_into(group: WeightSyncGroup | FileWeightSync, module: nn.Module, *, lora_only: bool = False,
                 engine: Any = None, **receive_kwargs: Any) -> int:
    """A rollout worker's side: receive one version into ``module`` (its own Hugging Face copy, LoRA-
    injected when ``lora_only``), then, with a vLLM ``engine``, push ``module`` into it
    (``engine.update_weights(module)`` merges LoRA adapters into the base names itself). Returns the
    version."""
    version = group.receive(lambda named: load_weights(module, named, lora_only=lora_only), **receive_kwargs)
    if engine is not None:
        engine.update_weights(module)
    return version
