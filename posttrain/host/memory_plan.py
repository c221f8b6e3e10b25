"""The run's memory plan: the levers chosen from what this machine has, announced in one console line.

A one-process CPU run (`posttrain.distributed.placement.InProcess`) decides here what ``auto`` means for the
keys that trade memory for nothing or little:

- ``<role>.optim.optimizer: auto`` -> ``adamw_8bit`` (`posttrain.optim.adamw8bit.AdamW8bit`: 2 bytes of
  moments a parameter instead of 8; for SmolLM2-135M 0.27 GB instead of 1.08 GB) on a CPU for a role
  that trains >= 10M parameters, ``AdamW`` elsewhere (GPU ranks, tiny models, LoRA adapters) or when
  ``optimizer_offload`` already pages the moments to a file.
- ``actor.fsdp_config.host_memory: auto`` -> ``balanced``: glibc's ``mmap`` threshold held at 8 MiB (where glibc
  would raise it to 32 MiB) and the heap's top kept for reuse (`posttrain.host.allocator.map_large_blocks`); the
  actor's update takes every block from the heap (`heap_allocations`: its micro-batches reuse the same large
  buffers), and the heap's free pages go back to the kernel after each rollout, before each optimizer step and
  after each update, so one phase's holes do not sit under the next. ``speed`` keeps every freed block in the heap
  for reuse (`posttrain.host.allocator.keep_freed_memory`), ``memory`` also maps the actor's rollout and update
  buffers and trims the heap after them (`posttrain.distributed.placement.memory_first`). balanced is the default
  because it gave the built-in run its lowest peak at the step time of ``speed`` (benchmarks/README.md, "Memory",
  has the figures and machines; benchmarks/CHANGELOG.md how they were reached).
- ``<role>.fsdp_config.host_paging: auto`` -> the role's idle state paged to a file in the temporary
  directory when that is on a disk (`idle_state_directory`): a frozen role's weights between its passes,
  a trained role's 8-bit moments between optimizer steps (`posttrain.optim.adamw8bit.AdamW8bit`'s
  ``directory``). The same numbers; it takes 0.27 + 0.27 GB out of the built-in run's update for
  SmolLM2-135M, at the price of mapping them back from the page cache once a step.

What the plan does not decide, and says: whether there is a reference model (KL used; under LoRA the
actor with its adapters off; DPO's ``dpo.precompute_ref_log_probs``), and its precision (the actor's
``param_dtype``: bf16 only where the CPU has bf16 instructions, `posttrain.models.compute_dtype`).
The line reads, e.g.::

    memory plan: CPU, 23.4 GiB RAM (20.1 free), no bf16 instructions; actor: AdamW moments 8-bit
    (adamw_8bit, 0.27 GB instead of 1.08 GB, updated in C); reference: frozen copy in fp32
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from posttrain.errors import ConfigError
from posttrain.host.paging import paging_directory

__all__ = ["MemoryPlan", "machine_ram"]

GiB = 2**30
MIN_PARAMS_8BIT = 10_000_000
"""``optim.optimizer: auto`` gives 8-bit moments from this many trained parameters on (below, the
float32 moments are < 80 MB: not worth the rounding)."""


def machine_ram(meminfo: str = "/proc/meminfo") -> tuple[float | None, float | None]:
    """(total, available) RAM in GiB from ``/proc/meminfo``; (None, None) where it cannot be read."""
    values = {}
    try:
        with open(meminfo) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    values[key] = int(rest.split()[0]) * 1024 / GiB
    except (OSError, ValueError, IndexError):
        return None, None
    return values.get("MemTotal"), values.get("MemAvailable")


@dataclass
class MemoryPlan:
    """The choices of one process's placement, gathered as the roles are built, said once (`line`)."""

    device: torch.device
    notes: list[str] = field(default_factory=list)

    def optimizer(self, requested: str, paged: bool, trained_params: int) -> str:
        """``adamw`` or ``adamw_8bit`` for a role whose ``optim.optimizer`` is ``requested`` (`optimizer_kind`);
        ``paged``: its moments already go to a file (``optimizer_offload``). ``auto`` keeps float32
        moments below `MIN_PARAMS_8BIT` trained parameters (tiny models, LoRA adapters: < 80 MB of moments)."""
        if requested != "auto":
            return requested  # external: another library's optimizer, built as asked
        small = trained_params < MIN_PARAMS_8BIT
        return "adamw_8bit" if self.device.type == "cpu" and not paged and not small else "adamw"

    def host_memory(self, requested: str) -> str:
        """``speed``, ``balanced`` or ``memory`` for ``fsdp_config.host_memory=requested`` (``auto``: balanced)."""
        return "balanced" if requested == "auto" else requested

    def idle_state_directory(self, requested: str, key: str) -> str | None:
        """Where a role pages its idle state for ``<key>=requested`` (``fsdp_config.host_paging``), None when it
        keeps it in memory: ``off``, a GPU, or (``auto``) a temporary directory held in memory (a tmpfs).
        ``on`` with a tmpfs is an error naming ``key`` (`posttrain.host.paging.paging_directory`)."""
        if requested == "off" or self.device.type != "cpu":
            return None
        try:
            return paging_directory(key)
        except ConfigError:
            if requested == "on":
                raise
            return None

    def note_host_memory(self, mode: str, requested: str) -> None:
        """``mode``: `host_memory`'s answer for ``requested``."""
        if self.device.type != "cpu":
            return
        how = "chosen" if requested == "auto" else "asked"
        self.notes.append({
            "memory": f"freed buffers returned to the kernel (host_memory=memory, {how}: a lower peak, slower steps)",
            "speed": f"freed buffers kept for reuse (host_memory=speed, {how}: the heap grows from step to step)",
            "balanced": f"buffers of 8 MiB and up returned to the kernel when freed outside the update, the update's "
                        f"reused from the heap, the heap's free pages returned after each rollout and update "
                        f"(host_memory=balanced, {how})",
        }[mode])

    def note_optimizer(self, role: str, kind: str, requested: str, paged: bool, trained_params: int,
                       idle_paged: bool = False, kernel: str = "C") -> None:
        """``kernel``: what updates the 8-bit moments (`posttrain.optim.adamw8bit.AdamW8bit.kernel`)."""
        how = "chosen" if requested == "auto" else "asked"
        if paged:
            self.notes.append(f"{role}: AdamW moments paged to a file (optimizer_offload)")
        elif kind == "adamw_8bit":
            between = ", paged to a file between steps (host_paging)" if idle_paged else ""
            update = ", updated in C" if kernel == "C" else ", updated by torch ops: no C kernel"
            self.notes.append(f"{role}: AdamW moments 8-bit (posttrain_adamw_8bit, {how}: {2 * trained_params / 1e9:.2f} GB instead "
                              f"of {8 * trained_params / 1e9:.2f} GB{between}{update})")
        elif kind == "external":
            self.notes.append(f"{role}: optimizer from optim.optimizer_impl (asked; its own state)")
        else:
            self.notes.append(f"{role}: AdamW moments fp32 ({8 * trained_params / 1e9:.2f} GB; {how})")

    def note_reference(self, kind: str, param_dtype: str, paged: bool = False) -> None:
        """``kind``: ``copy`` (a frozen copy of the weights), ``adapters-off`` (LoRA) or ``none``; ``paged``: the
        copy is paged to a file between passes."""
        if kind == "copy":
            kept = "bf16 (its compute precision)" if param_dtype == "bf16" else param_dtype
            self.notes.append(f"reference: frozen copy in {kept}" + (", paged to a file between passes" if paged else ""))
        elif kind == "adapters-off":
            self.notes.append("reference: the actor with its LoRA adapters off (no copy)")

    def line(self) -> str:
        from posttrain.host.cpu import cpu_bf16_support

        total, free = machine_ram()
        where = "CPU" if self.device.type == "cpu" else str(self.device)
        ram = f"{total:.1f} GiB RAM ({free:.1f} free)" if total is not None and free is not None else "RAM unknown"
        bf16 = "bf16 instructions" if cpu_bf16_support()[0] else "no bf16 instructions"
        return f"memory plan: {where}, {ram}, {bf16}; " + "; ".join(self.notes or ["nothing to choose"])
