"""How a role (actor, critic) writes and reads its state, in one process or sharded over ranks.

Two layouts of a role folder, both loadable at any world size:

- one process: ``model.safetensors`` + ``optimizer.pt`` (`posttrain.checkpoint.layout.write_role`);
- FSDP2 ranks: ``dcp/`` (`torch.distributed.checkpoint`: every rank writes its own shards, keyed
  by parameter name) + ``lr_scheduler.pt`` / ``generator.pt`` from rank 0 (every rank's own
  shuffle generator is also in its ``rng/rank_<r>.pt``, `posttrain.checkpoint.rank_rng`, which wins).

Both carry ``huggingface/`` (config, tokenizer) for export. With LoRA (``trainable_only``) the weights
and optimizer state are those of the trainable parameters alone (adapters, a critic's value head):
the frozen base is reloaded from the model path, and the adapter records which base it was
(`posttrain.models.lora`). A sharded role loads a one-process folder by reading the full tensors
on every rank and letting FSDP keep its shard; a one-process role loads a ``dcp/`` folder through
DCP's resharding (no process group needed). Nothing here executes code from a checkpoint:
safetensors, ``torch.load(weights_only=True)`` and DCP behind a restricted metadata reader
(`posttrain.checkpoint.dcp`).

`save_role` / `load_role_into` take a role by what it holds (``module``, ``optimizer``,
``lr_scheduler``, ``generator``, ``lora``), so storage imports no worker class.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from posttrain.checkpoint.dcp import load_sharded, save_sharded
from posttrain.checkpoint.layout import (GENERATOR_FILE, HF_DIR, MODEL_FILE, OPTIMIZER_FILE, SCHEDULER_FILE,
                                         CheckpointError, CheckpointWriteError, RoleState, check_weights_fit, load_role,
                                         open_tensors, safe_torch_load, write_failed_advice, write_role)
from posttrain.checkpoint.ranks import is_sharded, process_rank
from posttrain.host.disk import save_torch, writing

__all__ = ["DCP_DIR", "load_role_into", "load_role_state", "read_full_weights", "save_role", "save_role_state"]

DCP_DIR = "dcp"


def save_role(folder: str | Path, role: Any, *, tokenizer: Any = None, adapter_folder: bool = False) -> None:
    """Write ``role`` (its module, optimizer, lr schedule, shuffle generator and HF config) into the new
    ``folder``; sharded models: every rank calls it. With LoRA (``role.lora``) the weights are the
    trainable parameters alone, plus ``lora_base.json`` (which base they belong to), and with
    ``adapter_folder`` also ``lora_adapter/`` (a peft folder: the actor's export)."""
    lora, folder = role.lora, Path(folder)
    # a failed write is one error naming the path, raised on the rank that hit it (the driver reports it);
    # folder = <root>/.tmp_global_step_N_<pid>/<role>, so the advice names the checkpoint root
    with writing(folder, f"saving the {folder.name} checkpoint on rank {process_rank()} failed",
                 write_failed_advice(folder.parent.parent), error=CheckpointWriteError):
        save_role_state(folder, role.module, role.optimizer, role.lr_scheduler, role.generator,
                        hf_config=role.module.config, tokenizer=tokenizer, trainable_only=lora is not None)
        if hasattr(role.optimizer, "page_out"):  # optimizer_offload on CPU: the save read every moment
            role.optimizer.page_out()
        if lora is not None:
            write = lora.write if adapter_folder else lora.write_base_record
            write(folder, rank=process_rank())


def load_role_into(folder: str | Path, role: Any) -> None:
    """Restore what `save_role` wrote, at this or another world size (never executes code). LoRA:
    refused when the adapters were trained on other base weights."""
    if role.lora is not None:
        role.lora.check_base(folder)
    load_role_state(Path(folder), role.module, role.optimizer, role.lr_scheduler, role.generator,
                    trainable_only=role.lora is not None)


def _trainable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}


def save_role_state(folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any,
                    generator: torch.Generator, hf_config: Any = None, tokenizer: Any = None,
                    trainable_only: bool = False) -> None:
    """Write one role into the new ``folder``; under FSDP every rank calls this with the same folder.
    ``trainable_only``: weights of the trainable parameters alone (LoRA adapters, a value head)."""
    folder = Path(folder)
    if not is_sharded(module):
        weights = _trainable_state(module) if trainable_only else module.state_dict()
        write_role(folder, RoleState(model=weights, optimizer=optimizer.state_dict(),
                                     scheduler=lr_scheduler.state_dict(), generator=generator.get_state(),
                                     hf_config=hf_config, tokenizer=tokenizer))
        return
    if process_rank() == 0:
        folder.mkdir()
    dist.barrier()
    save_sharded(folder / DCP_DIR, module, optimizer, trainable_only=trainable_only)
    if process_rank() == 0:
        save_torch(lr_scheduler.state_dict(), folder / SCHEDULER_FILE)
        save_torch(generator.get_state(), folder / GENERATOR_FILE)
        if hf_config is not None:
            hf_config.save_pretrained(folder / HF_DIR)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder / HF_DIR)
    dist.barrier()  # the driver seals the checkpoint only once every rank has written


def load_role_state(folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any,
                    generator: torch.Generator, trainable_only: bool = False) -> None:
    """Restore a role from either layout, whatever the world size that wrote it. ``trainable_only``:
    the folder holds the trainable parameters' weights alone (the frozen ones keep their values)."""
    folder = Path(folder)
    if (folder / DCP_DIR).is_dir():
        load_sharded(folder / DCP_DIR, module, optimizer, trainable_only=trainable_only)
        _load_small_state(folder, lr_scheduler, generator)
        return
    if not (folder / MODEL_FILE).exists():
        raise CheckpointError(f"{folder} holds neither {MODEL_FILE} nor {DCP_DIR}/: not a role folder")
    if not trainable_only and not is_sharded(module):
        _load_weights_by_tensor(folder / MODEL_FILE, module)
        optimizer.load_state_dict(safe_torch_load(folder / OPTIMIZER_FILE))  # after the weights, not beside them
        _load_small_state(folder, lr_scheduler, generator)
        return
    state = load_role(folder)
    if trainable_only:
        _check_trainable_keys(folder, module, state.model)
    check_weights_fit(folder / MODEL_FILE, {k: tuple(v.shape) for k, v in state.model.items()},
                      {k: tuple(v.shape) for k, v in module.state_dict().items()}, strict=not trainable_only)
    if is_sharded(module):
        _load_full_into_sharded(module, optimizer, state, trainable_only)
    else:
        module.load_state_dict(state.model, strict=not trainable_only)
        optimizer.load_state_dict(state.optimizer)
    lr_scheduler.load_state_dict(state.scheduler)
    if state.generator is not None:
        generator.set_state(state.generator)


def _load_weights_by_tensor(path: Path, module: nn.Module) -> None:
    """``module.load_state_dict`` from ``path``, one saved tensor in memory at a time: the whole file read at
    once sat beside the optimizer's state and the model itself (a finished SFT run resumed peaked at 3.25 GB)."""
    from safetensors import SafetensorError

    targets = module.state_dict()  # the module's own tensors (a tied weight under each of its names)
    try:
        with open_tensors(path) as file:
            names = list(file.keys())
            check_weights_fit(path, {k: tuple(file.get_slice(k).get_shape()) for k in names},
                              {k: tuple(v.shape) for k, v in targets.items()})
            with torch.no_grad():
                for name in names:
                    targets[name].copy_(file.get_tensor(name))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err


def _load_small_state(folder: Path, lr_scheduler: Any, generator: torch.Generator) -> None:
    """The lr schedule and the shuffle generator, from their own files (both layouts write them alike)."""
    lr_scheduler.load_state_dict(safe_torch_load(folder / SCHEDULER_FILE))
    if (folder / GENERATOR_FILE).exists():
        generator.set_state(safe_torch_load(folder / GENERATOR_FILE))


def _check_trainable_keys(folder: Path, module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """A trainable-only folder must hold exactly this module's trainable parameters (same adapters)."""
    wanted = set(_trainable_state(module))
    missing, unexpected = sorted(wanted - set(weights)), sorted(set(weights) - wanted)
    if missing or unexpected:
        raise CheckpointError(f"{folder / MODEL_FILE} does not hold this model's trainable parameters (LoRA adapters): "
                              f"missing {missing[:3]}, unexpected {unexpected[:3]}; was it saved with other LoRA "
                              "settings, or by a full fine-tuning run?")


def _load_full_into_sharded(module: nn.Module, optimizer: torch.optim.Optimizer, state: RoleState,
                            trainable_only: bool = False) -> None:
    """A one-process checkpoint into FSDP2 units: every rank reads the full tensors and keeps its shard.

    ``optimizer.pt`` keys parameters by position: the ``i``-th parameter the optimizer holds, which
    is the ``i``-th (trainable) name of ``named_parameters()`` in the sharded module too.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = [name for name, p in module.named_parameters() if p.requires_grad or not trainable_only]
    saved = state.optimizer
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError("the checkpoint's optimizer has a different number of parameter groups")
    optim_state = {
        "state": {names[int(i)]: v for i, v in saved["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in saved["param_groups"]],
    }
    set_state_dict(module, (optimizer,), model_state_dict=state.model, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True, strict=not trainable_only))


def read_full_weights(folder: Path, module: nn.Module) -> dict[str, torch.Tensor]:
    """The full weights of a role folder (either layout) loaded into the unsharded ``module``; returns its
    state dict. Used by the export, in one process."""
    folder = Path(folder)
    if (folder / DCP_DIR).is_dir():
        load_sharded(folder / DCP_DIR, module)
        return module.state_dict()
    return load_role(folder).model
