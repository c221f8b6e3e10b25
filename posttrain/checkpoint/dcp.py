"""Sharded checkpoints of a role (model + optimizer) with ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards into one folder (``__<rank>_0.distcp`` files plus a ``.metadata``
index written by rank 0); a checkpoint loads at any world size, including one plain, unsharded
``nn.Module`` in a process without ``torch.distributed`` (DCP reshards on load). State dicts come
from ``get_state_dict`` / ``set_state_dict``, so keys are parameter names (FQNs) whether or not
the model is FSDP-sharded, and optimizer state is keyed by those names too.

Loading never executes code from the checkpoint (the project's rule, as
``torch.load(weights_only=True)`` elsewhere). torch's ``FileSystemReader`` reads ``.metadata``
with an unrestricted ``pickle.load`` and its ``DefaultLoadPlanner`` reads non-tensor entries
(optimizer hyper-parameters, lr-scheduler state) with ``torch.load(weights_only=False)``; both
would run whatever a crafted file asks. :class:`SafeFileSystemReader` unpickles the metadata
allowing only DCP's own metadata classes, torch dtypes/sizes/layouts and plain containers, and
:class:`WeightsOnlyLoadPlanner` loads non-tensor entries with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import warnings
from typing import IO, Any, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from posttrain.checkpoint.layout import CheckpointError, check_weights_fit

__all__ = [
    "SafeFileSystemReader",
    "UnsafeCheckpointError",
    "WeightsOnlyLoadPlanner",
    "full_state_dict_for_export",
    "load_sharded",
    "save_sharded",
]

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # looks a layout up by name in torch's own table
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},  # StorageMeta.checkpoint_id
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """A checkpoint file asked to load something other than plain checkpoint data; nothing was executed
    (a `CheckpointError`: the command line prints it as one line)."""


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals a DCP ``.metadata`` file legitimately uses."""

    def __init__(self, file: IO[bytes], path: str | os.PathLike):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()) or (module == "torch" and _is_torch_constant(name)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self._path}: refusing to unpickle {module}.{name} (only torch.distributed.checkpoint metadata "
            f"classes, torch dtypes and plain containers are allowed; this file may be malicious)")


def _is_torch_constant(name: str) -> bool:
    """``torch.float32``, ``torch.strided``, ``torch.contiguous_format``...: values, not callables."""
    return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is unpickled with an allow-list (see module docstring).

    Tensor data is already read with ``torch.load(weights_only=True)`` by the base class.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        metadata = self._checked.get(rank)
        if metadata is None:
            with self.fs.create_stream(path, "rb") as file:
                metadata = _MetadataUnpickler(file, path).load()
            if not isinstance(metadata, Metadata):
                raise UnsafeCheckpointError(f"{path}: expected DCP Metadata, found {type(metadata).__name__}")
            self._checked[rank] = metadata
        if getattr(metadata, "storage_meta", None) is None:  # as the base class: older files lack it
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    @property
    def _checked(self) -> dict[int | None, Metadata]:
        """Metadata already read (and checked) by this reader, by rank file (None: the global one)."""
        return self.__dict__.setdefault("_checked_metadata", {})


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor entries with ``torch.load(weights_only=True)``.

    ``source``: the checkpoint folder, named in the error when an entry is refused.
    """

    def __init__(self, *args: Any, source: str | os.PathLike = "checkpoint", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.source = source

    def load_bytes(self, read_item: Any, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(f"{self.source}: entry {fqn!r} is not plain data; refused without "
                                        f"executing it ({str(err).splitlines()[-1]})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _role_state(module: nn.Module, optimizer: torch.optim.Optimizer | None, extra: Mapping[str, Any] | None,
                options: StateDictOptions) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ..., "extra": ...}`` keyed by parameter names (FQNs).

    A fresh optimizer has no state yet; ``get_state_dict`` initialises it (a zero-lr step with
    zero gradients) so that a load has tensors to fill.
    """
    optimizers = (optimizer,) if optimizer is not None else ()
    model_sd, optim_sd = get_state_dict(module, optimizers, options=options)
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optim_sd
    if extra is not None:
        state["extra"] = dict(extra)
    return state


def _options(trainable_only: bool) -> StateDictOptions:
    """``trainable_only``: the parameters with ``requires_grad`` alone (LoRA adapters, a value head)."""
    return StateDictOptions(ignore_frozen_params=trainable_only)


def save_sharded(path: str | os.PathLike, module: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 extra: Mapping[str, Any] | None = None, *, trainable_only: bool = False) -> None:
    """Write ``module`` (+ ``optimizer``) state into the folder ``path``, every rank its own shards.

    A collective when ``torch.distributed`` is initialised: call on every rank with the same path
    (a filesystem all ranks see). ``extra``: further state saved alongside (tensors, numbers,
    lists, dicts, e.g. ``{"lr_scheduler": sched.state_dict()}``), replicated entries written once.
    ``trainable_only``: the trainable parameters and their optimizer state alone (the frozen base
    of a LoRA model reloads from its model path).
    """
    state = _role_state(module, optimizer, extra, _options(trainable_only))
    with _single_process_is_intended():
        dcp.save(state, storage_writer=FileSystemWriter(os.fspath(path)), no_dist=not _distributed())


def load_sharded(path: str | os.PathLike, module: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 extra: Mapping[str, Any] | None = None, *, trainable_only: bool = False) -> dict[str, Any] | None:
    """Load what :func:`save_sharded` wrote into ``module`` (+ ``optimizer``), at any world size.

    ``extra``: a template with the keys to read back (e.g. ``{"lr_scheduler": sched.state_dict()}``);
    returns the loaded extra dict (None without a template). Never unpickles code (module docstring);
    a tampered ``.metadata`` raises :class:`UnsafeCheckpointError` naming the file.
    ``trainable_only``: the folder holds the trainable parameters alone (saved with the same flag);
    the frozen ones keep their values, and a folder lacking any trainable one is refused.
    """
    reader = SafeFileSystemReader(os.fspath(path))
    # checked here, on every rank, so a refused file raises this error (dcp.load would wrap it and
    # fall back to per-rank metadata files)
    metadata = reader.read_metadata()
    options = _options(trainable_only)
    state = _role_state(module, optimizer, extra, options)
    if trainable_only:
        _check_trainable_saved(path, state["model"], metadata)
    _check_shapes(path, state["model"], metadata, strict=not trainable_only)
    planner = WeightsOnlyLoadPlanner(source=os.fspath(path))
    with _single_process_is_intended(), _refusals_unwrapped():
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=not _distributed())
    optimizers = (optimizer,) if optimizer is not None else ()
    # trainable-only: strict=False, the frozen parameters are absent on purpose (the rest was checked)
    set_state_dict(module, optimizers, model_state_dict=state["model"], optim_state_dict=state.get("optimizer", {}),
                   options=dataclasses.replace(options, strict=not trainable_only))
    return state.get("extra")


def _check_shapes(path: str | os.PathLike, model_state: Mapping[str, Any], metadata: Metadata, strict: bool) -> None:
    """The saved tensors' global shapes (from ``.metadata``) against this model's, before DCP reads any."""
    saved = {key[len("model."):]: tuple(md.size) for key, md in metadata.state_dict_metadata.items()
             if key.startswith("model.") and hasattr(md, "size")}
    model = {name: tuple(t.shape) for name, t in model_state.items() if isinstance(t, torch.Tensor)}
    check_weights_fit(path, saved, model, strict)


def _check_trainable_saved(path: str | os.PathLike, model_state: Mapping[str, Any], metadata: Metadata) -> None:
    """Every trainable parameter of this model is in the folder (the same LoRA adapters were saved)."""
    saved = set(metadata.state_dict_metadata)
    wanted = {f"model.{name}" for name in model_state}
    if not wanted <= saved:
        raise CheckpointError(f"{path} does not hold this model's trainable parameters (LoRA adapters), e.g. "
                              f"{sorted(wanted - saved)[:2]}; was it saved with other LoRA settings?")


def full_state_dict_for_export(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU weights for a Hugging Face export: on rank 0; ``{}`` on other ranks.

    A collective under FSDP (every rank must call it); gathers one tensor at a time into CPU
    memory, so only rank 0 needs room for the whole model. Without a process group: the module's
    own state dict, detached, on CPU.
    """
    if not _distributed():
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _refusals_unwrapped() -> Iterator[None]:
    """Re-raise an :class:`UnsafeCheckpointError` that DCP wrapped in a ``CheckpointException``."""
    try:
        yield
    except CheckpointException as err:
        refused = [exc for exc, _trace in err.failures.values() if isinstance(exc, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from err
        raise


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Silence DCP's "assuming ... a single process" warning: world size 1 without a group is supported."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
