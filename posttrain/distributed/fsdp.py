"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for posttrain's actor, reference and critic.

One process per rank; ``W`` ranks in the default process group (gloo on CPU, NCCL for CUDA
tensors with gloo for CPU ones). The recipe follows verl's ``apply_fsdp2``:

- one FSDP unit per decoder layer (class names in the HF model's ``_no_split_modules``), one each
  for the input embedding and ``lm_head`` when they are not tied, then the root. For posttrain's
  critic (:class:`~posttrain.models.value_model.ValueModel`, whose callers run ``backbone`` and
  ``value_head`` directly, never its ``forward``) the backbone and the value head are units of
  their own instead of the root, so every module that is called directly runs FSDP's hooks;
- ``fsdp_config`` keys as verl reads them: ``model_dtype`` (master weights), ``mixed_precision``
  (``MixedPrecisionPolicy``), ``offload_policy`` (``CPUOffloadPolicy``), ``param_offload`` /
  ``optimizer_offload`` (moves between phases: :func:`offload_model_to_cpu` ...),
  ``reshard_after_forward``, ``fsdp_size`` (HSDP mesh, :func:`build_mesh`), ``forward_prefetch``.

Gradient averaging. posttrain's losses are normalised by *global* token / sequence counts and
multiplied by the world size (``posttrain/workers/common.py::global_batch_info``), i.e. they expect
the DDP/FSDP convention "gradients are averaged over ranks". FSDP2's default path reduces with
``ReduceOp.AVG``, which gloo implemented as a plain sum (pytorch/pytorch#162338: a silent W-fold
gradient on CPU; torch 2.13's gloo averages correctly for FSDP and HSDP in our checks, but
posttrain accepts older torch). Every unit therefore reduces with ``ReduceOp.SUM`` and divides by
``W`` itself afterwards (``set_force_sum_reduction_for_comms(True)`` +
``set_gradient_divide_factor(W)``): the same average on gloo and NCCL, whatever the release.

Calling sub-modules directly. posttrain's log-prob code runs ``model.base_model`` and
``lm_head`` separately (to avoid ``[B, S, V]`` logits), which would skip the root unit's hooks
(the root owns the final norm, and a tied embedding). :func:`shard_model` therefore registers
``posttrain_fsdp_call(fn, *args)`` as an FSDP forward method of the root:
:func:`posttrain.models.logprobs.call_as_forward` runs ``fn`` inside the root's pre/post-forward
hooks, exactly as if ``model.forward`` had been called.

Generation. Decoding runs a data-dependent number of forward steps, different on each rank;
with sharded parameters every step would be an all-gather, and ranks would hang waiting for each
other. :func:`gathered_for_generation` all-gathers every unit once, stops resharding, and lets
the decoding loop run with no collectives at all.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import socket
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from posttrain.models.loading import enable_activation_checkpointing, parse_dtype
from posttrain.models.logprobs import FSDP_CALL_ATTR

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ShardInfo",
    "backend_for",
    "build_mesh",
    "fsdp_units",
    "gathered_for_generation",
    "init_distributed",
    "load_model_to_device",
    "load_optimizer",
    "offload_model_to_cpu",
    "offload_optimizer",
    "resident_for_phase",
    "run_local_ranks",
    "shard_model",
]

DEFAULT_TIMEOUT_S = 600
"""Process-group timeout (verl's ``actor_rollout_ref.nccl_timeout`` default)."""

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# --------------------------------------------------------------------------- process group, mesh
def backend_for(device_type: str) -> str:
    """``gloo`` for CPU runs; ``cpu:gloo,cuda:nccl`` for CUDA (CPU tensors, e.g. counts, still work)."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the default process group from ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``.

    A no-op when already initialised. ``backend`` defaults to :func:`backend_for` the visible
    device. On CUDA the rank's GPU is ``LOCAL_RANK`` (default ``RANK``). Returns ``(rank, world_size)``.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_distributed: environment variables {missing} are not set "
                           f"(a launcher such as torchrun or posttrain's worker group sets {list(_ENV)})")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = backend or backend_for("cuda" if torch.cuda.is_available() else "cpu")
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend=backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world


def build_mesh(device_type: str, world_size: int | None = None, fsdp_size: int = -1) -> DeviceMesh:
    """The FSDP device mesh: 1-D ``("fsdp",)`` over all ranks, or HSDP ``("replicate", "shard")``
    of shape ``(W // fsdp_size, fsdp_size)`` when ``0 < fsdp_size < W`` (parameters sharded within
    groups of ``fsdp_size`` consecutive ranks, replicated across groups).

    ``device_type`` is explicit ("cpu" on CPU runs even where a GPU is visible: a gloo group with a
    CUDA mesh moves parameters to the GPU, pytorch/pytorch#132471).
    """
    world = world_size if world_size is not None else dist.get_world_size()
    if 0 < fsdp_size < world:
        if world % fsdp_size:
            raise ValueError(f"fsdp_config.fsdp_size={fsdp_size} must divide the world size {world}")
        return init_device_mesh(device_type, (world // fsdp_size, fsdp_size), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",))


# --------------------------------------------------------------------------- sharding
@dataclass
class ShardInfo:
    """What :func:`shard_model` did; stored on the module as ``module.posttrain_fsdp``."""

    device: torch.device
    reshard_after_forward: bool
    cpu_offload_policy: bool
    param_offload: bool
    optimizer_offload: bool
    gradient_divide_factor: float
    gathered: bool = False
    """True inside :func:`gathered_for_generation`."""


def _cfg(section: Any, name: str, default: Any) -> Any:
    """``section.name`` with a default: the ref's fsdp_config lacks optimizer keys, dicts are allowed."""
    if isinstance(section, dict):
        return section.get(name, default)
    return getattr(section, name, default)


def _blocks(module: nn.Module) -> list[nn.Module]:
    """Decoder layers: modules whose class is named in some sub-model's ``_no_split_modules``."""
    names: set[str] = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return [m for m in module.modules() if type(m).__name__ in names]


def _embeddings(model: nn.Module) -> list[nn.Module]:
    """Input embedding and lm_head as units of their own, unless tied (then the root owns the shared weight)."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    embed = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    if embed is None:
        return []
    if head is None:  # a backbone (the critic's): its embedding
        return [embed]
    if getattr(head, "weight", None) is getattr(embed, "weight", None):
        return []
    return [embed, head]


def _is_value_model(module: nn.Module) -> bool:
    return hasattr(module, "backbone") and hasattr(module, "value_head")


def _mixed_precision(fsdp_config: Any, device: torch.device, param_dtype: str | None = None) -> MixedPrecisionPolicy:
    """``param_dtype`` for all-gathers and compute (the decided one when given, else the config's),
    ``reduce_dtype`` for gradient reduction.

    On CPU the all-gather stays in the master dtype: bf16 collectives over gloo are unreliable
    (pytorch/pytorch#111131), and posttrain's workers already compute in ``param_dtype`` through
    autocast, so only the transfer dtype differs.
    """
    mp = _cfg(fsdp_config, "mixed_precision", None)
    master = parse_dtype(_cfg(fsdp_config, "model_dtype", "fp32"))
    if param_dtype is not None:
        param = parse_dtype(param_dtype)
    else:
        param = parse_dtype(_cfg(mp, "param_dtype", "fp32")) if mp is not None else master
    reduce = parse_dtype(_cfg(mp, "reduce_dtype", "fp32")) if mp is not None else torch.float32
    if device.type == "cpu" or param == master:
        param = None
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, cast_forward_inputs=True)


def _offload_policy(fsdp_config: Any, forward_only: bool, device: torch.device) -> OffloadPolicy:
    """``CPUOffloadPolicy`` for ``offload_policy``, or a forward-only model with ``param_offload``.

    Meaningless on CPU (parameters already live there), so not applied; ``pin_memory`` needs CUDA.
    """
    wanted = bool(_cfg(fsdp_config, "offload_policy", False)) or (
        forward_only and bool(_cfg(fsdp_config, "param_offload", False)))
    if wanted and device.type != "cpu":
        return CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return OffloadPolicy()


def _cast_master_weights(module: nn.Module, fsdp_config: Any) -> None:
    """Parameters to ``model_dtype`` and floating buffers to ``mixed_precision.buffer_dtype``.

    Parameters and buffers separately: a whole-module ``.to(bf16)`` would also round the rotary
    ``inv_freq`` buffers, which transformers keeps in float32.
    """
    master = parse_dtype(_cfg(fsdp_config, "model_dtype", "fp32"))
    mp = _cfg(fsdp_config, "mixed_precision", None)
    buffer = parse_dtype(_cfg(mp, "buffer_dtype", "fp32")) if mp is not None else torch.float32
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.dtype != master:
                p.data = p.data.to(master)
        for b in module.buffers():
            if b.is_floating_point() and b.dtype != buffer:
                b.data = b.data.to(buffer)


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def shard_model(
    module: nn.Module,
    mesh: DeviceMesh,
    fsdp_config: Any,
    *,
    param_dtype: str | None = None,
    forward_only: bool = False,
    gradient_checkpointing: bool = False,
    gradient_divide_factor: float | None = None,
) -> nn.Module:
    """Shard ``module`` (a HF causal LM or a posttrain ``ValueModel``) in place with FSDP2; returns it.

    Args:
        module: the full model, identical on every rank (e.g. loaded from the same checkpoint).
        mesh: from :func:`build_mesh`.
        fsdp_config: a role's ``fsdp_config`` (``FSDPConfig``/``RefFSDPConfig`` or a dict).
        param_dtype: the compute precision decided for the role (``bf16``/``fp32``,
            `posttrain.workers.prepare.decide_param_dtype`); None: the config's ``mixed_precision.param_dtype``.
        forward_only: a reference model: parameters frozen; ``param_offload`` becomes
            ``CPUOffloadPolicy`` (as verl does for its ref).
        gradient_checkpointing: non-reentrant activation checkpointing, enabled before sharding.
        gradient_divide_factor: what the summed gradient is divided by; default ``W`` (the
            average posttrain's world-size-scaled losses expect). Tests pass 1 to break it on purpose.
    """
    device = _mesh_device(mesh)
    if gradient_checkpointing:
        enable_activation_checkpointing(module.backbone if _is_value_model(module) else module)
    _cast_master_weights(module, fsdp_config)
    if forward_only:
        module.requires_grad_(False)
    reshard = bool(_cfg(fsdp_config, "reshard_after_forward", True))
    offload = _offload_policy(fsdp_config, forward_only, device)
    blocks = _apply_fully_shard(module, dict(mesh=mesh, mp_policy=_mixed_precision(fsdp_config, device, param_dtype),
                                             offload_policy=offload, reshard_after_forward=reshard))
    factor = float(gradient_divide_factor if gradient_divide_factor is not None else mesh.size())
    _reduce_by_sum_then_divide(module, factor)
    if _cfg(fsdp_config, "forward_prefetch", False):
        for this, nxt in zip(blocks, blocks[1:]):
            this.set_modules_to_forward_prefetch([nxt])
    module.posttrain_fsdp = ShardInfo(
        device=device, reshard_after_forward=reshard, cpu_offload_policy=isinstance(offload, CPUOffloadPolicy),
        param_offload=bool(_cfg(fsdp_config, "param_offload", False)),
        optimizer_offload=bool(_cfg(fsdp_config, "optimizer_offload", False)), gradient_divide_factor=factor)
    return module


def _apply_fully_shard(module: nn.Module, kwargs: dict) -> list[nn.Module]:
    """``fully_shard`` per decoder layer, untied embedding / lm_head, then the root (or, for a
    ValueModel, its backbone and value head); returns the decoder layers."""
    blocks = _blocks(module)
    if not blocks:
        raise ValueError(f"shard_model: {type(module).__name__} names no decoder layers in _no_split_modules; "
                         "FSDP needs one unit per layer")
    value_model = _is_value_model(module)
    for unit in [*blocks, *_embeddings(module.backbone if value_model else module)]:
        fully_shard(unit, **kwargs)
    if value_model:
        fully_shard(module.backbone, **kwargs)
        fully_shard(module.value_head, **kwargs)
    else:
        fully_shard(module, **kwargs)
        _register_call(module)
    return blocks


def _reduce_by_sum_then_divide(module: nn.Module, factor: float) -> None:
    """Every unit reduces gradients with ``ReduceOp.SUM`` and then divides by ``factor``.

    Never ``ReduceOp.AVG`` (gloo summed instead of averaging, pytorch/pytorch#162338) nor
    ``PREMUL_SUM`` (NCCL-only): the same plain sum on every backend.
    """
    for unit in fsdp_units(module):
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(factor)


def _call(self, fn, *args, **kwargs):
    """Body of the root's extra forward method: FSDP's hooks run around it (see module docstring)."""
    return fn(*args, **kwargs)


def _register_call(root: nn.Module) -> None:
    setattr(root, FSDP_CALL_ATTR, _call.__get__(root, type(root)))
    register_fsdp_forward_method(root, FSDP_CALL_ATTR)


def fsdp_units(module: nn.Module) -> list[FSDPModule]:
    """Every FSDP unit in ``module`` (itself included), in ``modules()`` order: the same on all ranks."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


# --------------------------------------------------------------------------- generation
def _lazy_init(module: nn.Module) -> None:
    """Run the root's hooks once, so FSDP decides the root before any layer is called on its own.

    FSDP makes the first unit whose forward runs the root; a decoding loop that calls the
    backbone directly would otherwise crown a decoder layer. Gathers the root's own parameters
    (a collective, on every rank).
    """
    call = getattr(module, FSDP_CALL_ATTR, None)
    if call is not None:
        with torch.no_grad():
            call(lambda: None)


@contextlib.contextmanager
def gathered_for_generation(module: nn.Module) -> Iterator[nn.Module]:
    """All parameters of ``module`` unsharded for the ``with`` block; forwards inside run no collectives.

    Every rank all-gathers every unit once on entry (the same order on all ranks) and frees the
    gathered copies on exit; in between, FSDP's hooks find the parameters already gathered and do
    not reshard them, so a decoding loop may run a different number of forward steps on each rank
    (ranks stop at different EOS steps). Costs the memory of the full (``param_dtype``) model.
    Entry and exit are collectives: every rank must enter and leave the block. For training-free
    forwards only (no backward inside).
    """
    units = fsdp_units(module)
    if not units:
        yield module
        return
    info = getattr(module, "posttrain_fsdp", None)
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    _lazy_init(module)  # after the line above: the root's own parameters stay gathered from here on
    handles = [unit.unshard(async_op=True) for unit in units]
    for handle in handles:
        if handle is not None:
            handle.wait()
    if info is not None:
        info.gathered = True
    try:
        yield module
    finally:
        if info is not None:
            info.gathered = False
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(info.reshard_after_forward if info is not None else True, recurse=False)


# --------------------------------------------------------------------------- offload between phases
def offload_model_to_cpu(module: nn.Module) -> None:
    """Sharded parameters (and gradients) to CPU memory (``param_offload``; verl's semantics).

    A no-op under ``CPUOffloadPolicy`` (FSDP keeps them on CPU itself; moving such a module breaks
    its state dict, verl-project/verl#5995) and on CPU runs.
    """
    info = getattr(module, "posttrain_fsdp", None)
    if info is not None and (info.cpu_offload_policy or info.device.type == "cpu"):
        return
    module.to("cpu")  # FSDP reshards first, then moves the shards
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_model_to_device(module: nn.Module, device: str | torch.device | None = None) -> None:
    """Sharded parameters back to ``device`` (default: the mesh's) before a phase that uses them."""
    info = getattr(module, "posttrain_fsdp", None)
    if info is not None and info.cpu_offload_policy:
        return
    target = torch.device(device) if device is not None else (info.device if info is not None else None)
    if target is not None and target.type != "cpu":
        module.to(target)


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != device:
                state[key] = value.to(device, non_blocking=device.type != "cpu")
    if device.type != "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()  # non-blocking copies finished before the optimizer reads them


def offload_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Optimizer state tensors (AdamW moments, steps) to CPU memory (``optimizer_offload``)."""
    _move_optimizer_state(optimizer, torch.device("cpu"))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_optimizer(optimizer: torch.optim.Optimizer, device: str | torch.device) -> None:
    """Optimizer state back to ``device`` before ``optimizer.step()``."""
    _move_optimizer_state(optimizer, torch.device(device))


@contextlib.contextmanager
def resident_for_phase(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """Parameters (and optimizer state) on the device for the ``with`` block, back on CPU after it,
    according to the ``param_offload`` / ``optimizer_offload`` recorded by :func:`shard_model`.

    Wrap each phase that uses the model: ``with resident_for_phase(actor.module, actor.optimizer):
    actor.update_policy(batch)``; log-prob phases pass no optimizer.
    """
    info = getattr(module, "posttrain_fsdp", None)
    params = info is not None and info.param_offload
    optim = info is not None and info.optimizer_offload and optimizer is not None
    if params:
        load_model_to_device(module)
    if optim:
        load_optimizer(optimizer, info.device)
    try:
        yield
    finally:
        if optim:
            offload_optimizer(optimizer)
        if params:
            offload_model_to_cpu(module)


# --------------------------------------------------------------------------- local ranks (tests, one node)
def run_local_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                    timeout_s: float = 120.0, threads: int = 1, start_method: str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` local processes joined in a process group.

    Each process sets ``torch.set_num_threads(threads)``, the launcher environment variables and
    :func:`init_distributed` (``timeout_s`` turns a hang into an error). Returns what each rank
    returned, rank order; results travel through ``torch.save`` files and are read back with
    ``weights_only=True`` (tensors, numbers, strings, lists, dicts). ``start_method`` defaults to
    ``fork`` where the platform has it (no re-import of torch and transformers: seconds saved per
    rank) unless this process already holds a process group (a forked child would inherit it);
    ``spawn`` otherwise (then ``fn`` must be importable). A failing rank raises here with its traceback.
    """
    import torch.multiprocessing as torch_mp

    method = start_method or ("fork" if "fork" in multiprocessing.get_all_start_methods()
                              and not dist.is_initialized() else "spawn")
    with tempfile.TemporaryDirectory(prefix="posttrain-ranks-") as out_dir:
        torch_mp.start_processes(_local_rank_main, nprocs=world_size, join=True, start_method=method,
                                 args=(world_size, _free_port(), backend, timeout_s, threads, out_dir, fn, args))
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(world_size)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _local_rank_main(rank: int, world: int, port: int, backend: str, timeout_s: float, threads: int,
                     out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TOKENIZERS_PARALLELISM="false")
    init_distributed(backend, timeout_s)
    try:
        torch.save(fn(rank, world, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
