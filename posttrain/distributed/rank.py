"""`RankWorker`: everything one rank holds — the actor with its hybrid rollout, the reference, the
critic and the reward model, each an FSDP2-sharded model — and the calls a `RankWorkerGroup` makes on it.

One process per device (a Ray actor). The constructor joins the default process group from the
environment the group set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and builds
the roles from their specs (`posttrain.config.roles`) with the one-process group's builder
(`posttrain.workers.build.build_roles`), placed by `RankPlacement`: each model loaded on CPU and sharded over all ranks (``fsdp_config.fsdp_size`` for
HSDP), wrapped in the same `ActorWorker` / `RefWorker` / `CriticWorker`: construction and per-rank
math are one code path. This class only places: the process group, the mesh, each role resident on
the device for its phase, the actor gathered for generation. Batch sizes in the specs are per rank
already (`posttrain.config.worker_config`, or the SFT tree's own).

With the hf engine, generation runs inside `gathered_for_generation`: the actor's shards are
all-gathered once, and the decoding loop then runs without collectives, since ranks stop decoding
at different steps. A rollout engine that keeps its own copy of the weights (vLLM, one per rank)
is instead streamed the weights one gathered parameter at a time after each update, so no rank
ever holds a second full copy next to the engine's.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from posttrain.batch import Batch
from posttrain.workers.group import Call, bind_calls
from posttrain.host.resident import PhasePeaks

__all__ = ["RankPlacement", "RankWorker"]


class RankPlacement:
    """How a rank places a role (`posttrain.workers.prepare.Placement`): FSDP2 shards over ``mesh``
    (``fsdp_config`` says how, offload included: `RankWorker._resident` moves the state per phase),
    ``auto`` precision decided on rank 0, on its unsharded model, for every rank, and plain AdamW
    over each rank's shards."""

    def __init__(self, mesh: Any, device: torch.device, rank: int, world_size: int):
        self.mesh, self.device, self.rank, self.world_size = mesh, device, rank, world_size

    def agree(self, choose: Callable[[], str]) -> str:
        choice = [choose() if self.rank == 0 else None]
        torch.distributed.broadcast_object_list(choice, src=0)
        return choice[0]

    def shard(self, module: torch.nn.Module, fsdp_config: Any, param_dtype: str, *, forward_only: bool = False,
              gradient_checkpointing: bool = False, compile_key: str | None = None,
              fsdp_section: str = "") -> torch.nn.Module:
        """FSDP2 shards; ``compile_key`` set is refused on sharded modules (`enable_layer_compile` says so)."""
        from posttrain.distributed.fsdp import shard_model
        from posttrain.models.compile import enable_layer_compile

        module = shard_model(module, self.mesh, fsdp_config, param_dtype=param_dtype, forward_only=forward_only,
                             gradient_checkpointing=gradient_checkpointing)
        if compile_key is not None:
            enable_layer_compile(module, compile_key)
        return module

    @staticmethod
    def optimizer(module: torch.nn.Module, optim_config: Any, fsdp_config: Any, section: str) -> torch.optim.Optimizer:
        from posttrain.optim.build import build_optimizer, trainable_parameters

        return build_optimizer(trainable_parameters(module), optim_config)

    @staticmethod
    def one_pass(module: torch.nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # a sharded module's offload moves per phase (RankWorker._resident)


@bind_calls
class RankWorker:
    """The roles of one rank. Args: the role specs (`posttrain.config.roles.RoleSpecs`, per-rank sizes),
    the seed, the tokenizer, and ``device_type`` (``cpu`` with gloo, or ``cuda`` with NCCL)."""

    def __init__(self, specs: Any, seed: int, tokenizer: Any, device_type: str):
        from posttrain.host.allocator import keep_freed_memory, release_freed_memory
        from posttrain.distributed.fsdp import backend_for, build_mesh, init_distributed
        from posttrain.workers.build import build_roles

        keep_freed_memory()  # a rank is a process of its own (posttrain.host.allocator says why)

        # FSDP2 warns whenever a unit returns a view (the critic's value head does), because an in-place
        # op on it would skip a hook; posttrain's value and log-prob code never writes into those outputs.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        self.rank, world = init_distributed(backend_for(device_type), timeout_s=specs.timeout_s)
        self.seed, self.world_size = seed, world
        self.device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        torch.manual_seed(seed + self.rank)  # each rank samples its own responses
        mesh = build_mesh(device_type, world, specs.actor.fsdp.fsdp_size)
        self.roles = build_roles(specs, RankPlacement(mesh, self.device, self.rank, world), seed, tokenizer=tokenizer)
        self.actor, self.ref, self.critic, self.rm = self.roles.actor, self.roles.ref, self.roles.critic, self.roles.rm
        release_freed_memory()  # loading's transient copies back to the kernel (posttrain.host.allocator)
        self.memory = PhasePeaks()  # this rank's own resident memory, per phase (memory_metrics)
        self._weight_sync = None  # asynchronous runs: rank 0's end of the rollout workers' weight-sync group

    # ------------------------------------------------------------------ the group's calls
    def generate_sequences(self, prompts: Batch, validate: bool = False) -> Batch:
        """The hf engine decodes with the actor's module, gathered whole for the call; an engine with its
        own weights (vllm) needs no gather: the actor streams it one gathered parameter at a time
        (every rank in the same order, since each gather is a collective), then it generates alone."""
        from posttrain.distributed.fsdp import gathered_for_generation

        own = getattr(self.actor.rollout, "keeps_own_weights", False)
        with self._resident(self.actor, phase="gen"), (contextlib.nullcontext() if own else gathered_for_generation(self.actor.module)):
            return self.actor.generate_sequences(prompts, validate=validate)

    def _dispatch(self, name: str, call: Call, batch: Batch, **options: Any) -> Any:
        """Every other call of `CALLS`: the role's method with its state on the device for the call."""
        worker = getattr(self.roles, call.role)
        with self._resident(worker, with_optimizer=call.optimizer, phase=call.phase):
            return getattr(worker, call.method)(batch, **options)

    def save_checkpoint(self, folder: str) -> list[str]:
        """Every rank writes its shards of each role into ``folder/<role>/`` (a collective), and its own
        random state into ``folder/rng/rank_<r>.pt`` (`posttrain.checkpoint.rank_rng`)."""
        from posttrain.checkpoint.rank_rng import role_generators, save_rank_rng

        roles = self.roles.trained()
        for name, worker in roles.items():
            with self._resident(worker, with_optimizer=True):
                worker.save_checkpoint(Path(folder) / name)
        save_rank_rng(folder, self.rank, role_generators(roles))
        return list(roles)

    def load_checkpoint(self, folder: str) -> str:
        """Each role's state, then this rank's random state (its own when the checkpoint holds it, else
        reseeded: `posttrain.checkpoint.rank_rng`); returns what became of the random state."""
        from posttrain.checkpoint.rank_rng import load_rank_rng, role_generators

        roles = self.roles.trained()
        for name, worker in roles.items():
            with self._resident(worker, with_optimizer=True):
                worker.load_checkpoint(Path(folder) / name)
        return load_rank_rng(folder, self.rank, self.world_size, role_generators(roles), self.seed)

    def mark_step(self) -> None:
        """Remember this rank's random state as a step begins (the rollout is about to draw from it)."""
        from posttrain.checkpoint.rank_rng import capture_rank_rng, role_generators

        self._step_rng = capture_rank_rng(role_generators(self.roles.trained()))

    def rewind_step(self) -> None:
        """Back to the state `mark_step` remembered: the driver undid the step (stopped while scoring)."""
        from posttrain.checkpoint.rank_rng import restore_rank_rng, role_generators

        restore_rank_rng(self._step_rng, role_generators(self.roles.trained()))

    # ------------------------------------------------------------------ asynchronous rollouts
    @staticmethod
    def weight_sync_address() -> tuple[str, int]:
        """This node's IP and a port free on it: where rank 0 hosts the weight-sync rendezvous."""
        import ray

        from posttrain.distributed.cluster import free_port

        return ray.util.get_node_ip_address(), free_port()

    def join_weight_sync(self, sender: bool, host: str, port: int, world_size: int, backend: str,
                         timeout_s: float) -> None:
        """The sender (rank 0 of the trainer) joins the rollout workers' weight-sync group as its rank 0."""
        from posttrain.distributed.weight_sync import WeightSyncGroup

        if sender:
            self._weight_sync = WeightSyncGroup.create(host, port, 0, world_size, backend=backend, timeout_s=timeout_s)

    def push_weights(self, version: int, lora_only: bool) -> dict[str, float]:
        """Every rank walks the actor's weights (FSDP2 gathers each one: a collective); rank 0 sends them."""
        from posttrain.distributed.weight_sync import push_trainer_weights

        with self._resident(self.actor):
            return push_trainer_weights(self._weight_sync, self.actor.module, version, lora_only=lora_only)

    @staticmethod
    def ping(batch: Batch | None = None) -> int:
        """Rows received, nothing computed: a round trip that measures dispatch and gathering alone."""
        return 0 if batch is None else len(batch)

    @staticmethod
    def sees_file(path: str, token: str) -> bool:
        """Whether this rank reads ``token`` from ``path`` (the driver's shared-folder check)."""
        try:
            return Path(path).read_text() == token
        except OSError:
            return False

    def memory_metrics(self) -> dict[str, float]:
        """This rank's peak resident memory per phase since the last call, and its peak so far (`PhasePeaks`)."""
        return self.memory.take_metrics()

    @contextlib.contextmanager
    def _resident(self, worker: Any, with_optimizer: bool = False, phase: str | None = None):
        """``param_offload`` / ``optimizer_offload``: the role's state on the device for one phase;
        with ``phase`` (the trainer's stage name) this rank's peak resident memory in it is recorded."""
        from posttrain.distributed.fsdp import resident_for_phase

        placed = contextlib.nullcontext() if worker is None else resident_for_phase(
            worker.module, getattr(worker, "optimizer", None) if with_optimizer else None)
        with (self.memory(phase) if phase else contextlib.nullcontext()), placed:
            yield
