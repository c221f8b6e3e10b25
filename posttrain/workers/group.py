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
    memory_metrics() -> metrics                             ranks' peak resident memory per phase ({} in one process)
    save_checkpoint(folder) -> role names                   each role writes folder/<role>/, each rank
                                                            folder/rng/rank_<r>.pt (posttrain.checkpoint.rank_rng)
    load_checkpoint(folder)                                 each role reads folder/<role>/, each rank its RNG file
    mark_step() / rewind_step()                             each rank remembers its RNG state as a step begins /
                                                            goes back to it (the trainer undid the step)
    shutdown()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from posttrain.batch import Batch
from posttrain.workers.build import Roles, build_roles
from posttrain.workers.prepare import InProcess

__all__ = ["LocalWorkerGroup", "WorkerGroup", "build_local_group"]


@runtime_checkable
class WorkerGroup(Protocol):
    """What the trainer may call on its workers (see the module docstring for shapes)."""

    world_size: int
    seed: int
    """The run's seed (each rank seeds its generators from it; a rank reseeded at resume too)."""
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

    def mark_step(self) -> None: ...

    def rewind_step(self) -> None: ...

    def memory_metrics(self) -> dict[str, float]: ...

    def shutdown(self) -> None: ...


class LocalWorkerGroup:
    """The roles in this process: actor (with its hybrid rollout), optional reference, critic and reward model."""

    world_size = 1

    def __init__(self, actor: Any, ref: Any = None, critic: Any = None, rm: Any = None, seed: int = 0):
        self.actor, self.ref, self.critic, self.rm, self.seed = actor, ref, critic, rm, seed
        self.roles = Roles(actor, ref, critic, rm)
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
        """Each role's folder, and this process's random state as rank 0's (``rng/rank_0.pt``), so a run
        of several ranks resumed from it continues rank 0's streams."""
        from posttrain.checkpoint.rank_rng import role_generators, save_rank_rng

        roles = self.roles.trained()
        for name, worker in roles.items():
            worker.save_checkpoint(Path(folder) / name)
        save_rank_rng(folder, 0, role_generators(roles))
        return list(roles)

    def load_checkpoint(self, folder: Path) -> str:
        """Each role's state, then rank 0's saved random state (`posttrain.checkpoint.rank_rng`)."""
        from posttrain.checkpoint.rank_rng import load_rank_rng, role_generators

        roles = self.roles.trained()
        for name, worker in roles.items():
            worker.load_checkpoint(Path(folder) / name)
        return load_rank_rng(folder, 0, 1, role_generators(roles), self.seed)

    def mark_step(self) -> None:
        """The roles' shuffle generators as the step begins (the trainer rewinds the process's own)."""
        from posttrain.checkpoint.rank_rng import role_generators

        self._step_generators = {name: g.get_state() for name, g in role_generators(self.roles.trained()).items()}

    def rewind_step(self) -> None:
        from posttrain.checkpoint.rank_rng import role_generators

        for name, generator in role_generators(self.roles.trained()).items():
            generator.set_state(self._step_generators[name])

    def memory_metrics(self) -> dict[str, float]:
        """Nothing beyond the trainer's own ``memory/*``: the roles run in its process."""
        return {}

    def shutdown(self) -> None:
        """Nothing to stop in one process."""


def build_local_group(config: Any, device: torch.device, seed: int, actor_module: Any = None,
                      critic_module: Any = None, tokenizer: Any = None) -> LocalWorkerGroup:
    """Every role of the run in this process (`posttrain.workers.build.build_roles`, placed on ``device``)."""
    roles = build_roles(config, InProcess(device), seed, tokenizer=tokenizer, actor_module=actor_module,
                        critic_module=critic_module)
    return LocalWorkerGroup(roles.actor, roles.ref, roles.critic, roles.rm, seed=seed)
