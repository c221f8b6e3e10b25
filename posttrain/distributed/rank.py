"""`RankWorker`: everything one rank holds — the actor with its hybrid rollout, the reference, the
critic and the reward model, each an FSDP2-sharded model — and the calls a `RankWorkerGroup` makes on it.

One process per device (a Ray actor). The constructor joins the default process group from the
environment the group set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), loads each
model on CPU, shards it over all ranks (``fsdp_config.fsdp_size`` for HSDP) and wraps it in the
same `ActorWorker` / `RefWorker` / `CriticWorker` the one-process group uses: the per-rank math is
one code path. Batch sizes in ``config`` are per rank already (`posttrain.config.worker_config`).

With the hf engine, generation runs inside `gathered_for_generation`: the actor's shards are
all-gathered once, and the decoding loop then runs without collectives, since ranks stop decoding
at different steps. A rollout engine that keeps its own copy of the weights (vLLM, one per rank)
is instead streamed the weights one gathered parameter at a time after each update, so no rank
ever holds a second full copy next to the engine's.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from pathlib import Path
from typing import Any

import torch

from posttrain.batch import Batch

__all__ = ["RankWorker", "with_param_dtype"]


def with_param_dtype(section: Any, dtype: str) -> Any:
    """``section`` (a role's config holding ``fsdp_config``) with ``param_dtype: auto`` replaced by ``dtype``
    (`follow_actor`'s rule, in the form the sharding code reads: a config)."""
    from posttrain.workers.group import follow_actor

    chosen = follow_actor(section.fsdp_config, dtype)
    if chosen is None:
        return section
    section = copy.deepcopy(section)
    section.fsdp_config.mixed_precision.param_dtype = chosen
    return section


class RankWorker:
    """The roles of one rank. Args: the worker config (per-rank sizes), the seed, the tokenizer, and
    ``device_type`` (``cpu`` with gloo, or ``cuda`` with NCCL)."""

    def __init__(self, config: Any, seed: int, tokenizer: Any, device_type: str):
        from posttrain.allocator import keep_freed_memory
        from posttrain.config import uses_critic, uses_reference
        from posttrain.distributed.fsdp import backend_for, build_mesh, init_distributed

        keep_freed_memory()  # a rank is a process of its own (posttrain.allocator says why)

        # FSDP2 warns whenever a unit returns a view (the critic's value head does), because an in-place
        # op on it would skip a hook; posttrain's value and log-prob code never writes into those outputs.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        arr = config.actor_rollout_ref
        self.rank, world = init_distributed(backend_for(device_type), timeout_s=arr.nccl_timeout)
        self.device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        torch.manual_seed(seed + self.rank)  # each rank samples its own responses
        mesh = build_mesh(device_type, world, arr.actor.fsdp_config.fsdp_size)
        self.actor = self._build_actor(config, mesh, seed, tokenizer)
        self.ref = self._build_ref(config, mesh) if uses_reference(config) else None
        self.critic = self._build_critic(config, mesh, seed) if uses_critic(config) else None
        self.rm = self._build_reward_model(config, mesh, tokenizer, world) if config.reward_model.enable else None

    @staticmethod
    def _lora(module: torch.nn.Module, model_config: Any, section: str, model_dtype: str, seed: int,
              causal_lm: bool = True):
        """LoRA adapters injected into the full model, before sharding (as verl: ``get_peft_model``, then
        FSDP; FSDP2 shards frozen base and trainable adapter parameters alike), drawn from the run's
        seed so every rank builds the same ones; None without LoRA."""
        from posttrain.models.lora import apply_lora, lora_settings

        settings = lora_settings(model_config, section)
        if settings is None:
            return None
        return apply_lora(module, settings, model_path=model_config.path, model_dtype=model_dtype, causal_lm=causal_lm,
                          seed=seed)

    # ------------------------------------------------------------------ building the roles
    def _build_actor(self, config: Any, mesh: Any, seed: int, tokenizer: Any):
        from posttrain.distributed.fsdp import shard_model
        from posttrain.models import load_causal_lm
        from posttrain.workers import ActorWorker

        arr = config.actor_rollout_ref
        m = arr.model
        module = load_causal_lm(m.path, trust_remote_code=m.trust_remote_code, override_config=m.override_config,
                                dtype=arr.actor.fsdp_config.model_dtype, device="cpu")
        lora = self._lora(module, m, "actor_rollout_ref.model", arr.actor.fsdp_config.model_dtype, seed)
        actor_cfg = with_param_dtype(arr.actor, self._agreed_param_dtype(arr.actor.fsdp_config, module))
        module = shard_model(module, mesh, actor_cfg.fsdp_config,
                             gradient_checkpointing=bool(m.enable_gradient_checkpointing))
        return ActorWorker(m, actor_cfg, arr.rollout, device=self.device, module=module, tokenizer=tokenizer, seed=seed,
                           lora=lora)

    def _agreed_param_dtype(self, fsdp_config: Any, module: torch.nn.Module) -> str:
        """``param_dtype``, with ``auto`` decided on rank 0 (timed on its unsharded model) for every rank:
        ranks computing in different precisions would not be one data-parallel model."""
        from posttrain.models.compute_dtype import resolve_param_dtype

        requested = fsdp_config.mixed_precision.param_dtype
        if requested != "auto":
            return requested
        choice = [resolve_param_dtype(requested, module, self.device) if self.rank == 0 else None]
        torch.distributed.broadcast_object_list(choice, src=0)
        return choice[0]

    def _build_ref(self, config: Any, mesh: Any):
        from posttrain.distributed.fsdp import shard_model
        from posttrain.models import load_causal_lm
        from posttrain.workers import RefWorker
        from posttrain.workers.actor import LoraReference

        arr = config.actor_rollout_ref
        if self.actor.lora is not None:  # verl's ref in actor: the adapters disabled, no second model
            return LoraReference(self.actor, arr.ref)
        m = arr.model
        module = load_causal_lm(m.path, trust_remote_code=m.trust_remote_code, override_config=m.override_config,
                                dtype=arr.ref.fsdp_config.model_dtype, device="cpu")
        ref_cfg = with_param_dtype(arr.ref, self.actor.param_dtype)
        module = shard_model(module, mesh, ref_cfg.fsdp_config, forward_only=True)
        return RefWorker(module, ref_cfg, arr.rollout, device=self.device, remove_padding=bool(m.use_remove_padding),
                         compile_layers=bool(m.compile_layers))

    def _build_critic(self, config: Any, mesh: Any, seed: int):
        from posttrain.distributed.fsdp import shard_model
        from posttrain.models import load_value_model
        from posttrain.workers import CriticWorker

        c = config.critic.model
        module = load_value_model(c.path, trust_remote_code=c.trust_remote_code, override_config=c.override_config,
                                  dtype=c.fsdp_config.model_dtype, device="cpu")
        lora = self._lora(module.backbone, c, "critic.model", c.fsdp_config.model_dtype, seed, causal_lm=False)
        critic_cfg = copy.deepcopy(config.critic)
        critic_cfg.model = with_param_dtype(c, self.actor.param_dtype)
        module = shard_model(module, mesh, critic_cfg.model.fsdp_config,
                             gradient_checkpointing=bool(c.enable_gradient_checkpointing))
        return CriticWorker(critic_cfg, device=self.device, module=module, seed=seed, lora=lora)

    def _build_reward_model(self, config: Any, mesh: Any, tokenizer: Any, world: int):
        """Frozen and sharded like the reference: each rank scores its own rows (data parallel)."""
        from posttrain.distributed.fsdp import shard_model
        from posttrain.models.reward_model import import_external_lib, load_reward_model
        from posttrain.workers.reward_model import RewardModelWorker

        rm = config.reward_model
        m = rm.model
        import_external_lib(m.external_lib)
        module = load_reward_model(m.path, trust_remote_code=m.trust_remote_code, override_config=m.override_config,
                                   dtype=m.fsdp_config.model_dtype, device="cpu")
        rm_model = with_param_dtype(m, self.actor.param_dtype)
        module = shard_model(module, mesh, rm_model.fsdp_config, forward_only=True)
        return RewardModelWorker.from_config(rm, tokenizer, config.actor_rollout_ref.model.path, device=self.device,
                                             param_dtype=rm_model.fsdp_config.mixed_precision.param_dtype,
                                             world_size=world, module=module)

    # ------------------------------------------------------------------ the group's calls
    def generate_sequences(self, prompts: Batch, validate: bool = False) -> Batch:
        """The hf engine decodes with the actor's module, gathered whole for the call; an engine with its
        own weights (vllm) needs no gather: the actor streams it one gathered parameter at a time
        (every rank in the same order, since each gather is a collective), then it generates alone."""
        from posttrain.distributed.fsdp import gathered_for_generation

        own = getattr(self.actor.rollout, "keeps_own_weights", False)
        with self._resident(self.actor), (contextlib.nullcontext() if own else gathered_for_generation(self.actor.module)):
            return self.actor.generate_sequences(prompts, validate=validate)

    def compute_log_prob(self, batch: Batch):
        with self._resident(self.actor):
            return self.actor.compute_log_prob(batch)

    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor:
        with self._resident(self.ref):
            return self.ref.compute_ref_log_prob(batch)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        with self._resident(self.critic):
            return self.critic.compute_values(batch)

    def compute_rm_score(self, batch: Batch) -> torch.Tensor:
        with self._resident(self.rm):
            return self.rm.compute_rm_score(batch)

    def update_actor(self, batch: Batch) -> dict[str, float]:
        with self._resident(self.actor, with_optimizer=True):
            return self.actor.update_policy(batch)

    def update_critic(self, batch: Batch) -> dict[str, float]:
        with self._resident(self.critic, with_optimizer=True):
            return self.critic.update_critic(batch)

    def update_sft(self, batch: Batch) -> dict[str, float]:
        with self._resident(self.actor, with_optimizer=True):
            return self.actor.update_sft(batch)

    def compute_sft_loss(self, batch: Batch) -> torch.Tensor:
        with self._resident(self.actor):
            return self.actor.compute_sft_loss(batch)

    def compute_sequence_logps(self, batch: Batch) -> torch.Tensor:
        with self._resident(self.actor):
            return self.actor.compute_sequence_logps(batch)

    def compute_ref_sequence_logps(self, batch: Batch) -> torch.Tensor:
        with self._resident(self.ref):
            return self.ref.compute_sequence_logps(batch)

    def update_dpo(self, batch: Batch, beta: float, loss_type: str, label_smoothing: float) -> dict[str, float]:
        with self._resident(self.actor, with_optimizer=True):
            return self.actor.update_dpo(batch, beta, loss_type, label_smoothing)

    def save_checkpoint(self, folder: str) -> list[str]:
        """Every rank writes its shards of each role into ``folder/<role>/`` (a collective)."""
        roles = self._trained_roles()
        for name, worker in roles.items():
            with self._resident(worker, with_optimizer=True):
                worker.save_checkpoint(Path(folder) / name)
        return list(roles)

    def load_checkpoint(self, folder: str) -> None:
        for name, worker in self._trained_roles().items():
            with self._resident(worker, with_optimizer=True):
                worker.load_checkpoint(Path(folder) / name)

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

    def _trained_roles(self) -> dict[str, Any]:
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    @staticmethod
    def _resident(worker: Any, with_optimizer: bool = False):
        """``param_offload`` / ``optimizer_offload``: the role's state on the device for one phase."""
        from posttrain.distributed.fsdp import resident_for_phase

        if worker is None:
            return contextlib.nullcontext()
        return resident_for_phase(worker.module, getattr(worker, "optimizer", None) if with_optimizer else None)
