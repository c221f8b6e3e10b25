"""How a role (actor, critic) writes and reads its state, in one process or sharded over ranks.

Two layouts of a role folder, both loadable at any world size:

- one process: ``model.safetensors`` + ``optimizer.pt`` (`posttrain.checkpoint.write_role`);
- FSDP2 ranks: ``dcp/`` (`torch.distributed.checkpoint`: every rank writes its own shards, keyed
  by parameter name) + ``lr_scheduler.pt`` / ``generator.pt`` from rank 0.

Both carry ``huggingface/`` (config, tokenizer) for export. A sharded role loads a one-process
folder by reading the full tensors on every rank and letting FSDP keep its shard; a one-process
role loads a ``dcp/`` folder through DCP's resharding (no process group needed). Nothing here
executes code from a checkpoint: safetensors, ``torch.load(weights_only=True)`` and DCP behind a
restricted metadata reader (`posttrain.distributed.dcp`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from posttrain.checkpoint import (GENERATOR_FILE, HF_DIR, MODEL_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, CheckpointError,
                                  RoleState, load_role, safe_torch_load, write_role)

__all__ = ["DCP_DIR", "is_sharded", "load_role_state", "read_full_weights", "save_role_state"]

DCP_DIR = "dcp"


def is_sharded(module: nn.Module) -> bool:
    """True when ``module`` holds FSDP2 units and a process group is up (its state is per-rank)."""
    from torch.distributed.fsdp import FSDPModule

    return dist.is_available() and dist.is_initialized() and any(isinstance(m, FSDPModule) for m in module.modules())


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save_role_state(folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any,
                    generator: torch.Generator, hf_config: Any = None, tokenizer: Any = None) -> None:
    """Write one role into the new ``folder``; under FSDP every rank calls this with the same folder."""
    folder = Path(folder)
    if not is_sharded(module):
        write_role(folder, RoleState(model=module.state_dict(), optimizer=optimizer.state_dict(),
                                     scheduler=lr_scheduler.state_dict(), generator=generator.get_state(),
                                     hf_config=hf_config, tokenizer=tokenizer))
        return
    from posttrain.distributed.dcp import save_sharded

    if _rank() == 0:
        folder.mkdir()
    dist.barrier()
    save_sharded(folder / DCP_DIR, module, optimizer)
    if _rank() == 0:
        torch.save(lr_scheduler.state_dict(), folder / SCHEDULER_FILE)
        torch.save(generator.get_state(), folder / GENERATOR_FILE)
        if hf_config is not None:
            hf_config.save_pretrained(folder / HF_DIR)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder / HF_DIR)
    dist.barrier()  # the driver seals the checkpoint only once every rank has written


def load_role_state(folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any,
                    generator: torch.Generator) -> None:
    """Restore a role from either layout, whatever the world size that wrote it."""
    folder = Path(folder)
    if (folder / DCP_DIR).is_dir():
        from posttrain.distributed.dcp import load_sharded

        load_sharded(folder / DCP_DIR, module, optimizer)
        lr_scheduler.load_state_dict(safe_torch_load(folder / SCHEDULER_FILE))
        if (folder / GENERATOR_FILE).exists():
            generator.set_state(safe_torch_load(folder / GENERATOR_FILE))
        return
    if not (folder / MODEL_FILE).exists():
        raise CheckpointError(f"{folder} holds neither {MODEL_FILE} nor {DCP_DIR}/: not a role folder")
    state = load_role(folder)
    if is_sharded(module):
        _load_full_into_sharded(module, optimizer, state)
    else:
        module.load_state_dict(state.model)
        optimizer.load_state_dict(state.optimizer)
    lr_scheduler.load_state_dict(state.scheduler)
    if state.generator is not None:
        generator.set_state(state.generator)


def _load_full_into_sharded(module: nn.Module, optimizer: torch.optim.Optimizer, state: RoleState) -> None:
    """A one-process checkpoint into FSDP2 units: every rank reads the full tensors and keeps its shard.

    ``optimizer.pt`` keys parameters by position; the sharded module registers the same parameters
    in the same order, so position ``i`` is the ``i``-th name of ``named_parameters()``.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = [name for name, _ in module.named_parameters()]
    saved = state.optimizer
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError("the checkpoint's optimizer has a different number of parameter groups")
    optim_state = {
        "state": {names[int(i)]: v for i, v in saved["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in saved["param_groups"]],
    }
    set_state_dict(module, (optimizer,), model_state_dict=state.model, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))


def read_full_weights(folder: Path, module: nn.Module) -> dict[str, torch.Tensor]:
    """The full weights of a role folder (either layout) loaded into the unsharded ``module``; returns its
    state dict. Used by the export, in one process."""
    folder = Path(folder)
    if (folder / DCP_DIR).is_dir():
        from posttrain.distributed.dcp import load_sharded

        load_sharded(folder / DCP_DIR, module)
        return module.state_dict()
    return load_role(folder).model
