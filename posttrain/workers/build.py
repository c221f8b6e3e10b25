"""Every role of a run built once, for one process and for ranks alike.

Per role: load on CPU -> LoRA -> compute precision -> ``place.shard`` -> the worker, which receives
the ready module and asks the placement for its optimizer (`posttrain.workers.prepare` holds the
steps). The placement is the only thing that differs: the one-process placement
(`posttrain.distributed.placement.InProcess`) moves modules to the device and applies this machine's
levers (state kept in files on a CPU run, compiled layers); a rank's placement
(`posttrain.distributed.rank`) shards them with FSDP2 and lets rank 0 decide ``auto``.

    actor      the policy and its hybrid rollout engine; its ``param_dtype`` is decided (``auto``: timed)
    reference  when KL is used: the actor with its adapters disabled under LoRA (`LoraReference`,
               verl's "ref in actor"), else a frozen copy of the initial weights
    critic     for GAE
    reward     when ``reward_model.enable``, frozen
    teachers   when ``distillation.enabled``: frozen, each placed as the reference (`posttrain.workers.teacher`)
Each role but the actor computes in its own ``param_dtype``, or the actor's when its own is ``auto``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from posttrain.config.roles import RoleSpec, RoleSpecs
from posttrain.models.lora import lora_settings
from posttrain.workers.actor import ActorWorker, LoraReference, RefWorker
from posttrain.workers.critic import CriticWorker
from posttrain.workers.prepare import Placement, prepare
from posttrain.workers.reward_model import RewardModelWorker
from posttrain.workers.teacher import Teachers, TeacherWorker

__all__ = ["Roles", "build_roles"]


@dataclass
class Roles:
    """The roles one process (or one rank) holds; None where the run has no such role."""

    actor: Any
    ref: Any = None
    critic: Any = None
    rm: Any = None
    teachers: Any = None
    ref_in_actor: bool = False
    """The reference is the actor with its adapters disabled (LoRA: `LoraReference`), not a copy."""

    def trained(self) -> dict[str, Any]:
        """The roles a checkpoint holds, by folder name: the actor, and the critic when there is one."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}


def build_roles(specs: RoleSpecs, place: Placement, seed: int, *, tokenizer: Any = None, actor_module: Any = None,
                critic_module: Any = None) -> Roles:
    """Every role ``specs`` holds (`posttrain.config.roles`: from the RL or the SFT tree), placed by ``place``.

    Batch sizes in the specs are per rank. The reference is loaded from the actor's model path like
    the actor; only when the caller hands in an in-memory ``actor_module`` (tests, notebooks) is it a
    copy of that module's initial weights. ``tokenizer``: the actor's (loaded from the model path when
    None); ``seed`` draws the LoRA adapters and seeds the workers' shuffles.
    """
    ref_in_actor = lora_settings(specs.actor.model, "actor_rollout_ref.model") is not None
    copy_initial = actor_module is not None and specs.ref is not None and not ref_in_actor
    initial = copy.deepcopy(actor_module) if copy_initial else None
    actor = _actor(specs.actor, place, seed, tokenizer, actor_module)
    roles = Roles(actor, ref_in_actor=ref_in_actor)
    if specs.ref is not None:
        roles.ref = LoraReference(actor, specs.ref.section) if ref_in_actor else _reference(specs.ref, place, actor,
                                                                                            initial)
    if specs.critic is not None:
        roles.critic = _critic(specs.critic, place, seed, actor, critic_module)
    if specs.rm is not None:  # frozen, scored right after generation (posttrain.workers.reward_model)
        roles.rm = _reward_model(specs.rm, place, actor, specs.actor.model.path)
    if specs.teachers is not None:  # frozen, scoring the sampled tokens (on-policy distillation)
        roles.teachers = _teachers(specs.teachers, place, actor)
    return roles


def _actor(spec: RoleSpec, place: Placement, seed: int, tokenizer: Any, module: Any) -> ActorWorker:
    ready = prepare("policy", spec.model, spec.fsdp, place, section="actor_rollout_ref.model", module=module,
                    seed=seed)
    return ActorWorker(spec.model, spec.section, spec.rollout, device=place.device, module=ready.module,
                       tokenizer=tokenizer, seed=seed, lora=ready.lora, param_dtype=ready.param_dtype,
                       placement=place)


def _reference(spec: RoleSpec, place: Placement, actor: ActorWorker, initial: Any) -> RefWorker:
    """The frozen initial policy (no gradient checkpointing: the reference never trains)."""
    ready = prepare("policy", spec.model, spec.fsdp, place, section="actor_rollout_ref.model",
                    fsdp_section="actor_rollout_ref.ref", module=initial, actor_dtype=actor.param_dtype,
                    forward_only=True)
    return RefWorker(ready.module, spec.section, spec.rollout, device=place.device, param_dtype=ready.param_dtype,
                     remove_padding=bool(spec.model.use_remove_padding))


def _critic(spec: RoleSpec, place: Placement, seed: int, actor: ActorWorker, module: Any) -> CriticWorker:
    ready = prepare("value", spec.model, spec.fsdp, place, section="critic.model", module=module, seed=seed,
                    actor_dtype=actor.param_dtype)
    return CriticWorker(spec.section, device=place.device, module=ready.module, seed=seed, lora=ready.lora,
                        param_dtype=ready.param_dtype, placement=place)


def _teachers(spec: Any, place: Placement, actor: ActorWorker) -> Teachers:
    """Every teacher (`posttrain.config.distillation.TeacherSpecs`), each loaded from its path and placed as the
    reference is (``actor_rollout_ref.ref.fsdp_config``), in the actor's precision when that is ``auto``."""
    workers = {}
    for key, model in spec.models.items():
        ready = prepare("policy", model, spec.fsdp, place, section="actor_rollout_ref.model",
                        fsdp_section="actor_rollout_ref.ref", actor_dtype=actor.param_dtype, forward_only=True)
        workers[key] = TeacherWorker(ready.module, spec.section, topk=spec.topk, device=place.device,
                                     param_dtype=ready.param_dtype, remove_padding=spec.remove_padding)
    return Teachers(workers, spec.teacher_key, one_pass=place.one_pass)


def _reward_model(spec: RoleSpec, place: Placement, actor: ActorWorker, actor_path: str) -> RewardModelWorker:
    """Frozen and placed like the reference: on ranks each scores its own rows (data parallel)."""
    ready = prepare("reward", spec.model, spec.fsdp, place, fsdp_section="reward_model.model",
                    actor_dtype=actor.param_dtype, forward_only=True)
    return RewardModelWorker.from_config(spec.section, actor.tokenizer, actor_path, ready.module,
                                         device=place.device, param_dtype=ready.param_dtype,
                                         world_size=place.world_size)
