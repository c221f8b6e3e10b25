"""Where a role's state lives: this process's rank, and whether a module's state is per-rank.

Storage needs both facts (a sharded role writes ``dcp/`` from every rank, a plain one writes
safetensors from one process), and so do the models' forwards (a sharded forward is a collective).
They sit here, on the ground floor, so that storage asks nothing of the placement code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["is_sharded", "process_rank"]


def process_rank() -> int:
    """This process's rank in the default process group (0 in one process)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_sharded(module: torch.nn.Module) -> bool:
    """True when ``module`` holds FSDP2 units and a process group is up: its forwards and backwards are
    collectives (so every rank runs as many), and its state is per-rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    from torch.distributed.fsdp import FSDPModule  # only once a process group exists: keeps imports light

    return any(isinstance(m, FSDPModule) for m in module.modules())
