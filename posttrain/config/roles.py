"""What the worker builder (`posttrain.workers.build.build_roles`) reads: one `RoleSpec` per role.

Both config trees produce them: the RL tree from its sections (`rl_role_specs`), the SFT / DPO tree
from its own keys (`posttrain.config.sft_roles.sft_role_specs`). The specs are plain dataclasses of
config sections, so they travel to Ray ranks as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from posttrain.config.derived import uses_critic, uses_reference
from posttrain.config.distillation import teacher_specs

__all__ = ["RoleSpec", "RoleSpecs", "rl_role_specs", "specs_from_actor_rollout_ref"]


@dataclass
class RoleSpec:
    """One role's sections: ``model`` (path, LoRA, checkpointing: the reference's is the actor's),
    ``fsdp`` (master dtype, precision, sharding, offload), ``section`` (the worker's own keys:
    optimizer, micro-batches; the reward model's whole section) and ``rollout`` (sampling and
    log-prob micro-batches; actor and reference)."""

    model: Any
    fsdp: Any
    section: Any
    rollout: Any = None


@dataclass
class RoleSpecs:
    """The roles a run holds (None where it has no such role), and the ranks' collective timeout."""

    actor: RoleSpec
    ref: Optional[RoleSpec] = None
    critic: Optional[RoleSpec] = None
    rm: Optional[RoleSpec] = None
    teachers: Optional[Any] = None
    """On-policy distillation's teachers (`posttrain.config.distillation.TeacherSpecs`)."""
    timeout_s: float = 600
    """``actor_rollout_ref.nccl_timeout``: how long a rank waits in a collective."""


def specs_from_actor_rollout_ref(arr: Any, *, reference: bool) -> RoleSpecs:
    """The actor (and, when ``reference``, the reference) from an ``actor_rollout_ref`` section."""
    ref = RoleSpec(arr.model, arr.ref.fsdp_config, arr.ref, arr.rollout) if reference else None
    return RoleSpecs(RoleSpec(arr.model, arr.actor.fsdp_config, arr.actor, arr.rollout), ref,
                     timeout_s=arr.nccl_timeout)


def rl_role_specs(config: Any) -> RoleSpecs:
    """Every role the RL ``config`` asks for: the reference when KL is used, the critic for GAE, the
    reward model when ``reward_model.enable``, the teachers when ``distillation.enabled``. Batch sizes as
    ``config`` holds them (per rank: `posttrain.config.worker_config`)."""
    specs = specs_from_actor_rollout_ref(config.actor_rollout_ref, reference=uses_reference(config))
    if uses_critic(config):
        specs.critic = RoleSpec(config.critic.model, config.critic.model.fsdp_config, config.critic)
    rm = config.reward_model
    if rm.enable:
        specs.rm = RoleSpec(rm.model, rm.model.fsdp_config, rm)
    specs.teachers = teacher_specs(config)  # None unless distillation.enabled
    return specs
