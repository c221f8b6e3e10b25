"""A role's module made ready, the same way for every role and placement:
load on CPU -> LoRA -> compute precision -> placement.

Each step has one home here: `load_role_model` is the only place a role's model is loaded from its
config, `add_lora` the only place adapters are injected, `decide_param_dtype` the only place
``mixed_precision.param_dtype: auto`` is decided. A placement (`Placement`) says where the module
goes and how it runs, and hands out the optimizer: the one-process placement
(`posttrain.distributed.placement.InProcess`) moves it to the device and applies the machine's levers
(frozen weights and AdamW's moments kept in files on a CPU run, compiled decoder layers); a rank's FSDP2
placement (`posttrain.distributed.rank`) shards it and lets rank 0 decide ``auto`` for every rank.
The roles receive a placed module and never decide any of this.

`posttrain.workers.build` prepares every role of a run with `prepare`; a worker constructed
directly with a raw module (tests, notebooks) calls `prepare` itself with the placement it is given,
by default `OnDevice`: the device alone, no levers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import nn

from posttrain.models import enable_activation_checkpointing, load_causal_lm, load_value_model
from posttrain.models.compute_dtype import resolve_param_dtype
from posttrain.models.lora import LoraAdapter, apply_lora, lora_settings
from posttrain.models.reward_model import import_external_lib, load_reward_model
from posttrain.optim.build import build_optimizer, trainable_parameters

__all__ = ["OnDevice", "Placement", "ROLE_KINDS", "Ready", "add_lora", "decide_param_dtype", "follow_actor",
           "load_role_model", "prepare"]

ROLE_KINDS = ("policy", "value", "reward")
"""What a role loads: a causal LM (actor, reference), a value model (critic), a sequence classifier
(reward model)."""


class Placement(Protocol):
    """Where a ready module lives and how it runs, and the optimizer its trainable parameters get."""

    device: torch.device
    world_size: int
    """How many ranks share the roles (data parallel): a reward model's global micro-batch is split by it."""

    def agree(self, choose: Callable[[], str]) -> str:
        """``choose()`` once for everyone who must agree (one process: itself; ranks: rank 0's answer, broadcast)."""

    def shard(self, module: nn.Module, fsdp_config: Any, param_dtype: str, *, forward_only: bool = False,
              gradient_checkpointing: bool = False, compile_key: str | None = None,
              fsdp_section: str = "") -> nn.Module:
        """``module`` placed: moved to the device (one process) or FSDP2-sharded (ranks).

        ``compile_key``: the config key that turned compiled decoder layers on (None: off);
        ``fsdp_section``: where ``fsdp_config`` sits in the config (``actor_rollout_ref.ref``), named
        in the placement's errors."""

    def optimizer(self, module: nn.Module, optim_config: Any, fsdp_config: Any, section: str) -> torch.optim.Optimizer:
        """AdamW over ``module``'s trainable parameters (a LoRA base stays out: no state, no weight
        decay), from ``optim_config``; ``section``: where ``fsdp_config`` sits, for errors."""

    def one_pass(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """One pass of a frozen ``module`` placed by this placement: whatever it keeps out of memory between
        passes (weights paged to a file) is back for the block and out again after it."""


class OnDevice:
    """The device alone: nothing to shard or agree on, no machine levers; plain AdamW. What a worker
    built directly (tests, notebooks) uses unless it is handed another placement."""

    world_size = 1

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)

    @staticmethod
    def agree(choose: Callable[[], str]) -> str:
        return choose()

    def shard(self, module: nn.Module, fsdp_config: Any, param_dtype: str, *, forward_only: bool = False,
              gradient_checkpointing: bool = False, compile_key: str | None = None,
              fsdp_section: str = "") -> nn.Module:
        """Activation checkpointing when asked, then the device (``fsdp_config``: ranks only; compiled
        layers and offload are the one-process placement's levers, not applied here)."""
        if gradient_checkpointing:
            enable_activation_checkpointing(_language_model(module))
        return module.to(self.device)

    @staticmethod
    def optimizer(module: nn.Module, optim_config: Any, fsdp_config: Any, section: str) -> torch.optim.Optimizer:
        return build_optimizer(trainable_parameters(module), optim_config)

    @staticmethod
    def one_pass(module: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # nothing is paged here


@dataclass
class Ready:
    """A role's module after `prepare`: placed, with its adapters (None without LoRA) and the precision
    it computes in (``bf16`` / ``fp32``, never ``auto``)."""

    module: nn.Module
    lora: LoraAdapter | None
    param_dtype: str


def _language_model(module: nn.Module) -> nn.Module:
    """The transformer that adapters and checkpointing apply to: a value model's backbone, else the module."""
    return module.backbone if hasattr(module, "backbone") and hasattr(module, "value_head") else module


def load_role_model(kind: str, model_config: Any, model_dtype: str) -> nn.Module:
    """``model_config.path`` loaded on CPU in the master dtype ``model_dtype`` (placement moves it);
    ``kind``: one of `ROLE_KINDS`."""
    if kind == "reward":
        import_external_lib(model_config.external_lib)  # may register the reward model's class
    loader = {"policy": load_causal_lm, "value": load_value_model, "reward": load_reward_model}[kind]
    return loader(model_config.path, trust_remote_code=model_config.trust_remote_code,
                  override_config=model_config.override_config, dtype=model_dtype, device="cpu")


def add_lora(module: nn.Module, model_config: Any, section: str, model_dtype: str, seed: int) -> LoraAdapter | None:
    """LoRA adapters injected into the whole model before placement (as verl: ``get_peft_model``, then
    FSDP, which shards frozen base and trainable adapters alike), drawn from the run's ``seed`` so
    every rank builds the same ones; a value model's adapters go into its backbone (the value head
    stays trainable beside them). None when ``model_config`` asks for no LoRA."""
    settings = lora_settings(model_config, section) if model_config is not None else None
    if settings is None:
        return None
    target = _language_model(module)
    return apply_lora(target, settings, model_path=model_config.path, model_dtype=model_dtype,
                      causal_lm=target is module, seed=seed)


def decide_param_dtype(requested: str, module: nn.Module, device: torch.device,
                       agree: Callable[[Callable[[], str]], str] = OnDevice.agree) -> str:
    """``requested`` unless it is ``auto``; then the faster of bf16 and fp32 on this machine, timed on
    ``module`` (`posttrain.models.compute_dtype`) once for everyone ``agree`` speaks for: ranks
    computing in different precisions would not be one data-parallel model."""
    if requested != "auto":
        return requested
    return agree(lambda: resolve_param_dtype(requested, _language_model(module), device))


def follow_actor(fsdp_config: Any, actor_dtype: str) -> str:
    """A role other than the actor computes in its own ``param_dtype``, or, when that is ``auto``, in the
    actor's (reference log-probs comparable with the actor's; one precision per run)."""
    requested = fsdp_config.mixed_precision.param_dtype
    return actor_dtype if requested == "auto" else requested


def prepare(kind: str, model_config: Any, fsdp_config: Any, place: Placement, *, section: str = "",
            fsdp_section: str = "", module: nn.Module | None = None, lora: LoraAdapter | None = None,
            seed: int = 0, actor_dtype: str | None = None, forward_only: bool = False) -> Ready:
    """Load on CPU (unless ``module`` is given) -> LoRA (when ``model_config`` asks and ``lora`` is not
    given; never for a frozen role) -> precision (decided, or `follow_actor` when ``actor_dtype`` is
    given) -> ``place.shard``.

    ``model_config``: the role's model section (may be None with an in-memory ``module``: no LoRA, no
    checkpointing, no compiled layers); ``fsdp_config``: its ``fsdp_config`` (master dtype, precision,
    sharding, offload); ``section``: the model section's config path, named in LoRA and compile errors;
    ``fsdp_section``: ``fsdp_config``'s, named in offload errors; ``forward_only``: a frozen role.
    """
    if module is None:
        module = load_role_model(kind, model_config, fsdp_config.model_dtype)
    if lora is None and not forward_only:
        lora = add_lora(module, model_config, section, fsdp_config.model_dtype, seed)
    requested = fsdp_config.mixed_precision.param_dtype
    dtype = (follow_actor(fsdp_config, actor_dtype) if actor_dtype is not None
             else decide_param_dtype(requested, module, place.device, place.agree))
    checkpointing = bool(getattr(model_config, "enable_gradient_checkpointing", False)) and not forward_only
    compile_key = f"{section}.compile_layers" if getattr(model_config, "compile_layers", False) else None
    module = place.shard(module, fsdp_config, dtype, forward_only=forward_only, gradient_checkpointing=checkpointing,
                         compile_key=compile_key, fsdp_section=fsdp_section)
    return Ready(module, lora, dtype)
