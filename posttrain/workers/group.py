"""The worker boundary: every call the trainer makes on its workers, and the one-process group.

The trainer holds a `WorkerGroup` and nothing else of the workers. Each call takes and returns
plain batches, tensors, dicts of floats or paths, so the same calls can cross a process boundary:
`LocalWorkerGroup` runs the roles in this process (CPU or one GPU, no Ray needed), and
`posttrain.distributed.RankWorkerGroup` runs them on many ranks through Ray, splitting each batch
across the data-parallel ranks and gathering the results back in order.

    generate_sequences(prompts, validate=False) -> Batch    rollout (n samples per prompt)
    compute_log_prob(batch) -> (old_log_probs, entropy)     actor, no grad      [N, R] each
    compute_ref_log_prob(batch) -> ref_log_prob             reference policy    [N, R]
    compute_values(batch) -> values                         critic              [N, R]
    compute_rm_score(batch) -> rm_scores                    reward model        [N, R] (score on the last token)
    update_actor(batch) -> metrics                          PPO epochs on the actor
    update_critic(batch) -> metrics                         PPO epochs on the critic
    update_sft(batch) -> metrics                            SFT: one step of token-mean NLL (posttrain.workers.sft)
    compute_sft_loss(batch) -> [N, 2]                       per row: NLL sum over trained tokens, token count
    compute_sequence_logps(batch) -> [N, 2]                 per row: summed log-prob of trained tokens, count
    compute_ref_sequence_logps(batch) -> [N, 2]             the same under the reference (DPO)
    update_dpo(batch, beta, loss_type, label_smoothing)     DPO: one step on chosen/rejected row pairs
    save_checkpoint(folder) -> role names                   each role writes folder/<role>/
    load_checkpoint(folder)                                 each role reads folder/<role>/
    shutdown()
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from posttrain.batch import Batch

__all__ = ["LocalWorkerGroup", "WorkerGroup", "build_local_group"]


@runtime_checkable
class WorkerGroup(Protocol):
    """What the trainer may call on its workers (see the module docstring for shapes)."""

    world_size: int
    has_ref: bool
    has_critic: bool
    has_rm: bool

    def generate_sequences(self, prompts: Batch, validate: bool = False) -> Batch: ...

    def compute_log_prob(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor: ...

    def compute_values(self, batch: Batch) -> torch.Tensor: ...

    def compute_rm_score(self, batch: Batch) -> torch.Tensor: ...

    def update_actor(self, batch: Batch) -> dict[str, float]: ...

    def update_critic(self, batch: Batch) -> dict[str, float]: ...

    def save_checkpoint(self, folder: Path) -> list[str]: ...

    def load_checkpoint(self, folder: Path) -> None: ...

    def shutdown(self) -> None: ...


class LocalWorkerGroup:
    """The roles in this process: actor (with its hybrid rollout), optional reference, critic and reward model."""

    world_size = 1

    def __init__(self, actor: Any, ref: Any = None, critic: Any = None, rm: Any = None):
        self.actor, self.ref, self.critic, self.rm = actor, ref, critic, rm
        self.has_ref, self.has_critic, self.has_rm = ref is not None, critic is not None, rm is not None

    def generate_sequences(self, prompts: Batch, validate: bool = False) -> Batch:
        return self.actor.generate_sequences(prompts, validate=validate)

    def compute_log_prob(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.actor.compute_log_prob(batch)

    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor:
        return self.ref.compute_ref_log_prob(batch)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        return self.critic.compute_values(batch)

    def compute_rm_score(self, batch: Batch) -> torch.Tensor:
        return self.rm.compute_rm_score(batch)

    def update_actor(self, batch: Batch) -> dict[str, float]:
        return self.actor.update_policy(batch)

    def update_critic(self, batch: Batch) -> dict[str, float]:
        return self.critic.update_critic(batch)

    def update_sft(self, batch: Batch) -> dict[str, float]:
        return self.actor.update_sft(batch)

    def compute_sft_loss(self, batch: Batch) -> torch.Tensor:
        return self.actor.compute_sft_loss(batch)

    def compute_sequence_logps(self, batch: Batch) -> torch.Tensor:
        return self.actor.compute_sequence_logps(batch)

    def compute_ref_sequence_logps(self, batch: Batch) -> torch.Tensor:
        return self.ref.compute_sequence_logps(batch)

    def update_dpo(self, batch: Batch, beta: float, loss_type: str, label_smoothing: float) -> dict[str, float]:
        return self.actor.update_dpo(batch, beta, loss_type, label_smoothing)

    def save_checkpoint(self, folder: Path) -> list[str]:
        roles = {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}
        for name, worker in roles.items():
            worker.save_checkpoint(Path(folder) / name)
        return list(roles)

    def load_checkpoint(self, folder: Path) -> None:
        self.actor.load_checkpoint(Path(folder) / "actor")
        if self.critic is not None:
            self.critic.load_checkpoint(Path(folder) / "critic")

    def shutdown(self) -> None:
        """Nothing to stop in one process."""


def follow_actor(fsdp_config: Any, actor_dtype: str) -> str | None:
    """A role whose ``param_dtype`` is ``auto`` computes in the precision chosen for the actor."""
    return actor_dtype if fsdp_config.mixed_precision.param_dtype == "auto" else None


def build_local_group(config: Any, device: torch.device, seed: int, actor_module: Any = None,
                      critic_module: Any = None, tokenizer: Any = None) -> LocalWorkerGroup:
    """Actor (+ hybrid rollout), reference when KL is used, critic for GAE, reward model when
    ``reward_model.enable``, in this process.

    `config` holds per-rank batch sizes (`posttrain.config.worker_config`). The reference is loaded
    from ``actor_rollout_ref.model.path`` like the actor; only when the caller hands in an in-memory
    ``actor_module`` (tests, notebooks) is the reference a copy of that module's initial weights.
    With LoRA no reference model is loaded at all: the actor with its adapters disabled is the
    reference (`LoraReference`, verl's "ref in actor").
    """
    from posttrain.config import uses_critic, uses_reference
    from posttrain.models.lora import lora_settings
    from posttrain.workers import ActorWorker, CriticWorker, RefWorker
    from posttrain.workers.actor import LoraReference

    arr = config.actor_rollout_ref
    ref_in_actor = lora_settings(arr.model, "actor_rollout_ref.model") is not None
    copy_initial = actor_module is not None and uses_reference(config) and not ref_in_actor
    initial = copy.deepcopy(actor_module) if copy_initial else None
    actor = ActorWorker(arr.model, arr.actor, arr.rollout, device=device, module=actor_module,
                        tokenizer=tokenizer, seed=seed)
    ref = critic = None
    if uses_reference(config) and ref_in_actor:
        ref = LoraReference(actor, arr.ref)
    elif uses_reference(config):
        dtype = follow_actor(arr.ref.fsdp_config, actor.param_dtype)
        if initial is None:
            ref = RefWorker.from_config(arr.model, arr.ref, arr.rollout, device=device, param_dtype=dtype)
        else:
            ref = RefWorker(initial, arr.ref, arr.rollout, device=device, param_dtype=dtype,
                            remove_padding=bool(arr.model.use_remove_padding),
                            compile_layers=bool(arr.model.compile_layers))
    if uses_critic(config):
        critic = CriticWorker(config.critic, device=device, module=critic_module, seed=seed,
                              param_dtype=follow_actor(config.critic.model.fsdp_config, actor.param_dtype))
    rm = None
    if config.reward_model.enable:  # frozen, scored right after generation (posttrain.workers.reward_model)
        from posttrain.workers.reward_model import RewardModelWorker

        rm = RewardModelWorker.from_config(config.reward_model, actor.tokenizer, arr.model.path, device=device,
                                           param_dtype=follow_actor(config.reward_model.model.fsdp_config,
                                                                    actor.param_dtype))
    return LocalWorkerGroup(actor, ref, critic, rm)
