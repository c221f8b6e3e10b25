"""Decoder layers run through ``torch.compile`` in the scoring and training forwards, not in generation.

Most of a CPU training step that is not matmul is memory-bound elementwise work: RMSNorm, rotary
embeddings, SiLU x up-projection, residual adds, autocast's casts, each a separate pass over the
activations. Inductor fuses them per decoder layer, which makes the update and the reference pass
clearly faster; the first compilation costs most of a minute on the first step (cached on disk by
inductor, seconds on later runs), which is why the key is opt-in. Measured by hand (a forward, a
forward + backward) and in the trainer with ``benchmarks/bench_ab.py``: figures and machine in
benchmarks/README.md, "Compiled layers".

One compiled wrapper (``torch.compile(layer, dynamic=True)``: every sequence length and batch size
reuses one graph per mode) is made per layer and swapped into the model's layer list only inside
:func:`compiled_layers`, so generation (whose KV-cache calls would recompile per layer and per
step), ``state_dict`` keys and optimizer parameters see the original modules. Autograd keeps what
the forward ran, so the backward may run after the block ends.

Not supported (refused at start-up with the key's name): FSDP2-sharded modules, whose per-layer
hooks would have to run inside the compiled graph.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from posttrain.models.microbatch import is_sharded

__all__ = ["compiled_layers", "decoder_layers", "disable_layer_compile", "enable_layer_compile"]

_ATTR = "posttrain_compiled_layers"
"""Attribute ``enable_layer_compile`` sets on the model: ``(layer list, compiled wrappers)``. A tuple,
so ``nn.Module`` does not register the wrappers as submodules."""


def decoder_layers(model: nn.Module, key: str = "actor_rollout_ref.model.compile_layers") -> nn.ModuleList:
    """The model's list of decoder layers: the longest ``nn.ModuleList`` whose entries share one class
    (``model.model.layers`` for Llama/Qwen, ``transformer.h`` for GPT-2, through a peft wrapper too)."""
    best: nn.ModuleList | None = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            if best is None or len(module) > len(best):
                best = module
    if best is None:
        raise ValueError(f"{key}=True: found no list of decoder layers in {type(model).__name__}; set {key}=False")
    return best


def enable_layer_compile(model: nn.Module, key: str = "actor_rollout_ref.model.compile_layers") -> None:
    """Make a compiled wrapper for each decoder layer of ``model`` (compiled on first use)."""
    if is_sharded(model):
        raise ValueError(f"{key}=True is not supported on FSDP2-sharded ranks (more than one rank); "
                         f"set {key}=False")
    layers = decoder_layers(model, key)
    wrappers = tuple(torch.compile(layer, dynamic=True) for layer in layers)
    object.__setattr__(model, _ATTR, (layers, wrappers))


def disable_layer_compile(model: nn.Module) -> None:
    """Undo :func:`enable_layer_compile`: the scoring forwards run eager again (compiled graphs stay
    cached, so enabling again does not recompile)."""
    if hasattr(model, _ATTR):
        object.__delattr__(model, _ATTR)


@contextlib.contextmanager
def compiled_layers(model: nn.Module) -> Iterator[None]:
    """Inside the block, ``model``'s decoder layers are their compiled wrappers (when
    :func:`enable_layer_compile` was called on ``model``; otherwise nothing changes)."""
    entry = getattr(model, _ATTR, None)
    if entry is None:
        yield
        return
    layers, wrappers = entry
    originals = list(layers)
    for i, wrapper in enumerate(wrappers):
        layers[i] = wrapper
    try:
        yield
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
