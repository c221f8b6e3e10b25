"""The run's memory plan: the levers chosen from what this machine has, announced in one console line.

A one-process CPU run (`posttrain.host.placement.InProcess`) decides here what ``auto`` means for the
keys that trade memory for nothing or little:

- ``<role>.optim.optimizer: auto`` -> ``adamw_8bit`` (`posttrain.host.adamw8bit.AdamW8bit`: 2 bytes of
  moments a parameter instead of 8; for SmolLM2-135M 0.27 GB instead of 1.08 GB) on a CPU for a role
  that trains >= 10M parameters, ``AdamW`` elsewhere (GPU ranks, tiny models, LoRA adapters) or when
  ``optimizer_offload`` already pages the moments to a file.
- ``actor.fsdp_config.host_memory: auto`` -> ``memory`` on a machine with less than
  `MEMORY_FIRST_BELOW_GIB` of RAM, else ``speed``: whether the actor's rollout and update hand their
  freed blocks back to the kernel (`posttrain.host.placement.memory_first`). Kept for reuse (speed), the
  heap's holes grow the peak step by step (the built-in run: 3.7 GB after 6 steps, 3.95 GB after 15);
  handed back (memory), it grows less (3.1 GB after 6, 3.46 GB after 15), with steps ~1.26x as long
  (fresh pages are zero-filled: ~0.9 s a GB on a 2-core VM). benchmarks/README.md has the figures.

What the plan does not decide, and says: whether there is a reference model (KL used; under LoRA the
actor with its adapters off; DPO's ``dpo.precompute_ref_log_probs``), and its precision (the actor's
``param_dtype``: bf16 only where the CPU has bf16 instructions, `posttrain.models.compute_dtype`).
The line reads, e.g.::

    memory plan: CPU, 23.4 GiB RAM (20.1 free), no bf16 instructions; actor: AdamW moments 8-bit
    (adamw_8bit, 0.27 GB instead of 1.08 GB); reference: frozen copy in fp32
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["MemoryPlan", "machine_ram"]

GiB = 2**30
MEMORY_FIRST_BELOW_GIB = 12
"""``host_memory: auto`` chooses memory over speed on machines with less RAM than this (an 8 GB laptop,
where the OS and a browser hold half)."""
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
            return requested
        small = trained_params < MIN_PARAMS_8BIT
        return "adamw_8bit" if self.device.type == "cpu" and not paged and not small else "adamw"

    def memory_first(self, requested: str, total_ram_gib: float | None = None) -> bool:
        """Whether the actor's rollout and update run memory-first for ``fsdp_config.host_memory=requested``
        (``auto``: below `MEMORY_FIRST_BELOW_GIB` of RAM on a CPU; ``total_ram_gib``: this machine's by default)."""
        if requested != "auto":
            return requested == "memory"
        if self.device.type != "cpu":
            return False
        total = machine_ram()[0] if total_ram_gib is None else total_ram_gib
        return total is not None and total < MEMORY_FIRST_BELOW_GIB

    def note_host_memory(self, memory_first: bool, requested: str) -> None:
        how = "chosen" if requested == "auto" else "asked"
        if memory_first:
            self.notes.append(f"freed buffers returned to the kernel (host_memory=memory, {how}: a lower peak, "
                              "slower steps)")
        elif self.device.type == "cpu":
            self.notes.append(f"freed buffers kept for reuse (host_memory=speed, {how})")

    def note_optimizer(self, role: str, kind: str, requested: str, paged: bool, trained_params: int) -> None:
        how = "chosen" if requested == "auto" else "asked"
        if paged:
            self.notes.append(f"{role}: AdamW moments paged to a file (optimizer_offload)")
        elif kind == "adamw_8bit":
            self.notes.append(f"{role}: AdamW moments 8-bit ({kind}, {how}: {2 * trained_params / 1e9:.2f} GB instead "
                              f"of {8 * trained_params / 1e9:.2f} GB)")
        else:
            self.notes.append(f"{role}: AdamW moments fp32 ({8 * trained_params / 1e9:.2f} GB; {how})")

    def note_reference(self, kind: str, param_dtype: str) -> None:
        """``kind``: ``copy`` (a frozen copy of the weights), ``adapters-off`` (LoRA) or ``none``."""
        if kind == "copy":
            kept = "bf16 (its compute precision)" if param_dtype == "bf16" else param_dtype
            self.notes.append(f"reference: frozen copy in {kept}")
        elif kind == "adapters-off":
            self.notes.append("reference: the actor with its LoRA adapters off (no copy)")

    def line(self) -> str:
        from posttrain.models.compute_dtype import cpu_bf16_support

        total, free = machine_ram()
        where = "CPU" if self.device.type == "cpu" else str(self.device)
        ram = f"{total:.1f} GiB RAM ({free:.1f} free)" if total is not None and free is not None else "RAM unknown"
        bf16 = "bf16 instructions" if cpu_bf16_support()[0] else "no bf16 instructions"
        return f"memory plan: {where}, {ram}, {bf16}; " + "; ".join(self.notes or ["nothing to choose"])
