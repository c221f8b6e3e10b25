"""What autograd keeps for backward, counted by the tests that claim a layer keeps less."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch


@dataclass
class Kept:
    """The storages autograd kept inside a `kept_for_backward` block (each once; parameters, in memory anyway,
    not counted) and the shape of every tensor it kept."""

    storages: dict[int, int] = field(default_factory=dict)  # data pointer -> bytes
    shapes: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


@contextlib.contextmanager
def kept_for_backward() -> Iterator[Kept]:
    """Count, inside the block, what autograd saves for backward (`Kept`)."""
    kept = Kept()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            kept.storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            kept.shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield kept
