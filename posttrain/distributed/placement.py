"""`InProcess`: the one-process placement, where this machine's levers meet the roles.

What FSDP2's placement does for ranks (`posttrain.distributed.rank.RankPlacement`: shard, offload
to CPU memory between phases), this one does for a single process: move each module to the device,
and on a CPU run apply the levers the config asks for, so that no role decides them:

- ``param_offload`` on a frozen role (the reference, the reward model), or ``host_paging`` (``auto``: where
  the temporary directory is on a disk): its weights paged to a file and dropped from memory after each
  pass (`posttrain.host.paging`);
- ``host_paging`` on a trained role with 8-bit moments: the moments paged to a file between optimizer
  steps (`posttrain.optim.adamw8bit.AdamW8bit`), so the update's forward and backward do not hold them;
- ``optimizer_offload``: AdamW's moments paged to a file, one parameter's in memory at a time
  (`posttrain.host.paging.PagedAdamW`), and the actor's rollout and update run memory-first
  (`resident`);
- ``host_memory``: glibc's own policy for freed memory (``auto``/``balanced``), every freed block kept
  for reuse (``speed``), or the actor's rollout and update run memory-first (``memory``);
  `posttrain.host.memory_plan` says what each costs;
- ``compile_layers``: the decoder layers through ``torch.compile`` in the scoring and training
  forwards (`posttrain.models.compile`; on any device);
- a frozen role that computes in bf16: its weights kept in bf16 (`store_frozen_in_bf16`), half an fp32
  copy's memory for the same products (autocast would round them to bf16 at every matmul anyway);
- a trained role that computes in bf16: its layers keep less for backward (`posttrain.models.lean.backward`:
  the fp32 weights rather than a bf16 cast of each, the norms' inputs rather than their outputs);
- a trained role's input embedding: in the update, its gradient's rows summed into ``.grad`` rather than a
  zero-filled vocabulary-sized tensor per micro-batch (`posttrain.models.lean.into_grad`);
- ``optim.optimizer: auto``: the memory plan's choice (`posttrain.host.memory_plan`: 8-bit AdamW moments
  on a CPU), said in one console line once the roles are built (`announce_plan`).

The keys that exist only for this placement (``host_paging``, ``host_memory``) reach it from the config when it
is made (`HostLevers`, by `posttrain.trainer.setup.build_local_group`), not through the workers' calls: a worker
hands its module and the verl keys FSDP reads too (offload, precision); the placement looks up its own levers by
the role's config section.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from posttrain.optim.adamw8bit import AdamW8bit
from posttrain.host.allocator import (heap_allocations, keep_freed_memory, map_large_blocks, mapped_allocations,
                                      release_freed_memory)
from posttrain.host.memory_plan import MemoryPlan
from posttrain.host.paging import offload_directory, one_pass, page_module, page_out_after_each_layer, paged_weights
from posttrain.host.process_tree import start_run_peak
from posttrain.models.compile import decoder_layers, enable_layer_compile
from posttrain.models.lean.into_grad import embeddings_add_into_grad
from posttrain.models.lean.backward import keep_less_for_backward
from posttrain.optim.build import build_optimizer, optimizer_kind, trainable_parameters
from posttrain.optim.paged import PagedAdamW
from posttrain.workers.prepare import OnDevice

__all__ = ["HostLevers", "InProcess", "OptimizerChoice", "MEMORY_FIRST_PHASES", "memory_first", "store_frozen_in_bf16"]

MEMORY_FIRST_PHASES = ("gen", "update_actor")
"""The actor's rollout and update: the phases whose large short-lived buffers (logits, the rollout's
cache, gradients) `memory_first` keeps out of the heap when ``optimizer_offload`` chose memory, and
after which ``host_memory=balanced`` returns the heap's free pages (`InProcess.resident`)."""


PAGED_SECTIONS = {"actor": "actor_rollout_ref.actor", "ref": "actor_rollout_ref.ref", "critic": "critic.model",
                  "rm": "reward_model.model", "teachers": "actor_rollout_ref.ref"}
"""A role of `posttrain.config.roles.RoleSpecs` -> the config section whose ``fsdp_config`` it is placed by (the
teachers are placed as the reference is); the placement names a role by this section in its calls and errors."""


@dataclass(frozen=True)
class HostLevers:
    """The one-process run's host levers as the config sets them, read from the run's roles where the placement is
    made (`posttrain.trainer.setup.build_local_group`), so that no role's worker carries them:

    - ``paging``: a config section (`PAGED_SECTIONS`) -> its ``fsdp_config.host_paging`` (``auto``/``on``/``off``);
      a section not in it is ``auto``;
    - ``host_memory``: ``actor_rollout_ref.actor.fsdp_config.host_memory``.
    """

    paging: Mapping[str, str] = field(default_factory=dict)
    host_memory: str = "auto"

    @classmethod
    def of(cls, specs: Any) -> "HostLevers":
        """The levers of the roles ``specs`` holds (`posttrain.config.roles.RoleSpecs`, from the RL or the SFT tree)."""
        paging = {}
        for role, section in PAGED_SECTIONS.items():
            spec = getattr(specs, role, None)
            if spec is not None:
                paging.setdefault(section, _setting(spec.fsdp, "host_paging", "auto"))
        return cls(paging, _setting(specs.actor.fsdp, "host_memory", "auto"))

    def host_paging(self, section: str) -> str:
        """``<section>.fsdp_config.host_paging``."""
        return self.paging.get(section, "auto")


@dataclass(frozen=True)
class OptimizerChoice:
    """One role's optimizer as the placement decided it, before it is built (`InProcess.choose_optimizer`)."""

    kind: str
    """What is built (`posttrain.optim.names`: ``adamw``, ``adamw_8bit``, ...)."""
    requested: str
    """What ``optim.optimizer`` asked (``auto``: the memory plan chose ``kind``)."""
    trained_params: int
    offload_dir: str | None = None
    """``optimizer_offload``: AdamW's moments paged to a file in this folder (`PagedAdamW`)."""
    idle_dir: str | None = None
    """``host_paging``: the 8-bit moments paged to a file in this folder between optimizer steps."""


class InProcess(OnDevice):
    """One process: the module moves to ``device``, with the levers of the module docstring.

    The worker group's contract (`posttrain.workers.group.LocalWorkerGroup`, built with this
    placement): every data call on a role runs inside ``resident(worker, with_optimizer=...,
    phase=...)``, with the call's row of `posttrain.workers.group.CALLS` (its phase is the trainer's
    stage name: ``gen`` for generation, ``update_actor`` for every update of the actor). A worker
    used without a group computes the same numbers; only the memory `resident` hands back stays.
    """

    def shard(self, module: nn.Module, fsdp_config: Any, param_dtype: str, *, forward_only: bool = False,
              gradient_checkpointing: bool = False, compile_key: str | None = None,
              fsdp_section: str = "") -> nn.Module:
        """On the device (`OnDevice.shard`); a trained bf16 role's layers keeping less for backward; a trained
        role's input embedding adding its gradient into ``.grad``; a frozen role's weights paged to a file when
        its ``param_offload`` asks on a CPU run; compiled decoder layers when ``compile_key`` is set."""
        module = super().shard(module, fsdp_config, param_dtype, forward_only=forward_only,
                               gradient_checkpointing=gradient_checkpointing)
        if forward_only and param_dtype == "bf16":
            store_frozen_in_bf16(module)
        elif param_dtype == "bf16":
            keep_less_for_backward(module)
        if not forward_only:  # its gradient summed into .grad inside the update's micro-step (into_grad)
            embeddings_add_into_grad(module)
        if forward_only:
            asked = offload_directory(fsdp_config, "param_offload", fsdp_section, module, self.device)
            directory = asked or self._idle_state_directory(fsdp_section, module)
            if directory is not None and self._page_or_keep(
                    lambda: page_module(module, directory, f"the weights of {fsdp_section or 'a frozen model'}"),
                    fsdp_section, fsdp_section, asked=asked is not None) is not None:
                with contextlib.suppress(ValueError):  # no list of decoder layers: paged out after the whole pass
                    page_out_after_each_layer(module, decoder_layers(module))
        if compile_key is not None:
            enable_layer_compile(module, compile_key)
        return module

    def __init__(self, device: str | torch.device, levers: HostLevers | None = None):
        super().__init__(device)
        self.levers = HostLevers() if levers is None else levers  # None: every lever auto (tests, notebooks)
        self.plan = MemoryPlan(self.device)
        self._host_memory: dict[int, str] = {}  # the actor optimizer's id -> its host_memory mode (memory_plan)
        self._actor_optimizer: tuple[torch.optim.Optimizer, bool] | None = None  # (it, its moments offloaded)
        start_run_peak()  # the run's process-tree peak is sampled from before its models load

    def optimizer(self, module: nn.Module, optim_config: Any, fsdp_config: Any, section: str) -> torch.optim.Optimizer:
        """The role's optimizer, in two plain calls: what to build (`choose_optimizer`), then built
        (`_build_optimizer`); said in the memory plan line. The process's host memory mode is set later, once (`settle`)."""
        params = trainable_parameters(module)
        choice = self.choose_optimizer(module, params, optim_config, fsdp_config, section)
        optimizer = self._build_optimizer(params, optim_config, choice, section)
        role = section.removesuffix(".model")  # the critic's fsdp_config sits in critic.model, its optim in critic
        self.plan.note_optimizer(role.rsplit(".", 1)[-1], choice.kind, choice.requested, choice.offload_dir is not None,
                                 choice.trained_params, getattr(optimizer, "_paged", None) is not None,
                                 getattr(optimizer, "kernel", "C"))
        if role == "actor_rollout_ref.actor":  # its host memory mode is set once every role is built (settle)
            self._actor_optimizer = (optimizer, choice.offload_dir is not None)
        return optimizer

    def choose_optimizer(self, module: nn.Module, params: list, optim_config: Any, fsdp_config: Any,
                         section: str) -> "OptimizerChoice":
        """``optim.optimizer`` (``auto``: as the memory plan decides, `posttrain.host.memory_plan`: 8-bit moments on a
        CPU), where ``<section>.fsdp_config.optimizer_offload`` pages AdamW's moments (a CPU run), and where
        ``host_paging`` pages 8-bit moments between steps. Nothing is built."""
        role = section.removesuffix(".model")
        requested = optimizer_kind(optim_config, f"{role}.optim.optimizer")
        offload = offload_directory(fsdp_config, "optimizer_offload", section, module, self.device)
        if offload is not None and requested == "adamw_8bit":
            raise ValueError(f"{section}.optim.optimizer=posttrain_adamw_8bit and {section}.fsdp_config.optimizer_offload=True "
                             "both shrink AdamW's moments; choose one (8-bit moments stay in memory, offloaded ones "
                             "are paged to a file)")
        count = sum(p.numel() for p in {id(p): p for p in params}.values())
        kind = self.plan.optimizer(requested, paged=offload is not None, trained_params=count)
        idle = self._idle_state_directory(section, module) if offload is None and kind == "adamw_8bit" else None
        return OptimizerChoice(kind, requested, count, offload, idle)

    def _build_optimizer(self, params: list, optim_config: Any, choice: "OptimizerChoice",
                         section: str) -> torch.optim.Optimizer:
        """`build_optimizer` as ``choice`` says; 8-bit moments whose file ``host_paging=auto`` could not reserve
        stay in memory (`_page_or_keep`)."""
        if choice.idle_dir is not None:
            paged = functools.partial(AdamW8bit, directory=choice.idle_dir)
            built = self._page_or_keep(lambda: build_optimizer(params, optim_config, paged, kind=choice.kind),
                                       section, section.removesuffix(".model"))
            if built is not None:
                return built
        make = None if choice.offload_dir is None else functools.partial(PagedAdamW, directory=choice.offload_dir)
        return build_optimizer(params, optim_config, make, kind=choice.kind)

    @staticmethod
    def one_pass(module: nn.Module) -> contextlib.AbstractContextManager:
        """A frozen module's paged weights (``param_offload`` / ``host_paging``) in memory for the block only."""
        return one_pass(paged_weights(module))

    def set_host_memory(self, optimizer: torch.optim.Optimizer, paged: bool) -> None:
        """``actor_rollout_ref.actor.fsdp_config.host_memory`` for the actor's phases (`resident`), chosen by the
        memory plan: the whole process's allocator policy, so set once, after every role is built. Paged moments
        run the phases memory-first."""
        requested = self.levers.host_memory
        mode = "memory" if paged else self.plan.host_memory(requested)
        if mode in ("speed", "memory") and self.device.type == "cpu":
            keep_freed_memory()  # memory-first maps its own phases' buffers; the rest is kept for reuse
        elif mode == "balanced" and self.device.type == "cpu":
            map_large_blocks()  # blocks of 8 MiB and up mapped and unmapped, not left as holes in the heap
            # the micro-batches' activations are free by the step: their pages go back before the step's
            # own (the moments mapped in, their dequantised copies) come on top of them
            optimizer.register_step_pre_hook(_release_before_step)
        self._host_memory[id(optimizer)] = mode
        if not paged:  # the paged case is said by note_optimizer
            self.plan.note_host_memory(mode, requested)

    def _page_or_keep(self, page: Any, section: str, what: str, asked: bool = False) -> Any:
        """``page()`` (it puts a role's state in a file), or None where ``host_paging=auto`` could not reserve the
        file (a full disk): the state stays in memory, said in the plan line. Where the user asked for paging
        (``host_paging=on``, or ``asked``: ``param_offload``) the error stands."""
        try:
            return page()
        except OSError as err:
            if asked or self.levers.host_paging(section) != "auto":
                raise
            self.plan.notes.append(f"{what}: kept in memory, not paged (host_paging=auto: {err.strerror or err})")
            return None

    def _idle_state_directory(self, section: str, module: nn.Module) -> str | None:
        """Where ``<section>.fsdp_config.host_paging`` pages this role's idle state (`MemoryPlan.idle_state_directory`);
        None when it stays in memory, or when the module is sharded on ranks (their offload is FSDP2's)."""
        if getattr(module, "posttrain_fsdp", None) is not None:
            return None
        return self.plan.idle_state_directory(self.levers.host_paging(section), f"{section}.fsdp_config.host_paging")

    def announce_plan(self) -> None:
        """The memory plan's one console line (after every role is built)."""
        print(self.plan.line(), flush=True)

    def settle(self, roles: Any) -> None:
        """Once every role is built (`posttrain.workers.build.Roles`; called by whoever made this placement:
        `posttrain.trainer.setup.build_local_group`): the process's host memory mode for the actor's phases
        (`set_host_memory`), then the memory plan's line, with what the reference and each distillation teacher
        keep, and where."""
        if self._actor_optimizer is not None:
            self.set_host_memory(*self._actor_optimizer)
        if roles.ref is not None:
            paged = paged_weights(getattr(roles.ref, "module", None)) is not None
            self.plan.note_reference("adapters-off" if roles.ref_in_actor else "copy",
                                     getattr(roles.ref, "param_dtype", "fp32"), paged)
        else:
            self.plan.notes.append("no reference model (no KL term, or a KL coefficient of 0)")
        for key, teacher in (roles.teachers.teachers.items() if roles.teachers is not None else ()):
            kept = "bf16 (its compute precision)" if teacher.param_dtype == "bf16" else teacher.param_dtype
            paged = ", paged to a file between passes" if paged_weights(teacher.module) is not None else ""
            self.plan.notes.append(f"teacher {key}: frozen in {kept}{paged}")
        self.announce_plan()

    @contextlib.contextmanager
    def resident(self, worker: Any, *, with_optimizer: bool = False, phase: str | None = None) -> Iterator[None]:
        """One call on ``worker`` (None: nothing to do): its paged weights, if any, dropped from memory
        after the call however it ends (`posttrain.host.paging.one_pass`); and when its role chose memory
        over speed (paged moments, or ``host_memory``), the phases of `MEMORY_FIRST_PHASES` run `memory_first`;
        under ``host_memory=balanced`` the actor's rollout and update return the heap's free pages once done.
        ``with_optimizer``: nothing to move in one process (the moments page themselves)."""
        paged = paged_weights(getattr(worker, "module", None))
        mode = self._host_memory.get(id(getattr(worker, "optimizer", None)))
        first = phase in MEMORY_FIRST_PHASES and mode == "memory"
        balanced = mode == "balanced" and self.device.type == "cpu"
        with one_pass(paged), (memory_first() if first else contextlib.nullcontext()), (
                heap_allocations() if balanced and phase == "update_actor" else contextlib.nullcontext()):
            yield  # balanced: the update's large buffers reused from micro-batch to micro-batch, not mapped afresh
        if phase in MEMORY_FIRST_PHASES and balanced:
            # the update's activations leave holes between the tensors that outlive it (gradients, moments):
            # kept, the next update's peak crept up from step to step (the multi-turn retry run: 3.62 -> 3.72
            # GB over 4 steps). The rollout's cache and logits are sizes the scoring passes do not reuse:
            # kept, they sat under the reference pass and the update (the retry run's peak, 6 steps: 2.86 GB;
            # returned here and before the optimizer step, 2.71)
            release_freed_memory()


def _release_before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """An optimizer step pre-hook (it must return None: torch reads a result as new arguments)."""
    release_freed_memory()


def _setting(section: Any, key: str, default: Any) -> Any:
    """``section.key`` of a config section (a dataclass, an OmegaConf node or a plain dict)."""
    return section.get(key, default) if isinstance(section, dict) else getattr(section, key, default)


def store_frozen_in_bf16(module: nn.Module) -> None:
    """A frozen module's floating-point parameters converted to bf16 in place (tied ones once).

    Under bf16 autocast every matmul already reads its weight rounded to bf16, so the products are the
    same; what changes is the small rest (norm scales, embeddings), which moves only the frozen role's
    scores (the KL term, the reward model's value) by bf16 rounding, as verl's bf16 reference does.
    Buffers stay as they are: the rotary frequencies in bf16 would shift every position's angle."""
    with torch.no_grad():
        for param in module.parameters():
            if param.is_floating_point() and param.dtype != torch.bfloat16:
                param.data = param.data.to(torch.bfloat16)


@contextlib.contextmanager
def memory_first() -> Iterator[None]:
    """The block's large buffers get mappings of their own, unmapped when freed, and what the heap
    freed goes back to the kernel after it (`posttrain.host.allocator`): otherwise freed memory stays
    for the next phase to reuse, and the holes between longer-lived tensors grow the heap from step
    to step. It lowers the peak and costs some speed (fresh pages are zero-filled): measured by
    ``benchmarks/bench_memory.py`` (its docstring has the figures)."""
    with mapped_allocations():
        yield
    release_freed_memory()
