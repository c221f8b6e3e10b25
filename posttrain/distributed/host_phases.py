"""`HostPhases`: this machine's levers at the trainer's phase boundaries (the thread count, freed memory), so
the trainer names its phases and the placement's room decides what a phase boundary does on this host."""

from __future__ import annotations

import torch

from posttrain.host.allocator import release_freed_memory
from posttrain.host.threads import FreeCoreThreads, wait_policy_choice

__all__ = ["HostPhases"]


class HostPhases:
    """This machine's levers at the trainer's phase boundaries, so the trainer names phases, not levers.

    - before each stage (generation, scoring, the update, validation): as many torch threads as other
      processes leave free, for a process whose OpenMP threads spin (`posttrain.host.threads.FreeCoreThreads`;
      ``adjust_threads`` false keeps the count given: Ray ranks, torchrun ranks, the async trainer);
    - after the models load and after validation: the heap's freed pages back to the kernel (loading's transient
      copies, the held-out decoding's buffers: no training phase reuses their sizes).
    """

    def __init__(self, adjust_threads: bool):
        self.threads = FreeCoreThreads(enabled=adjust_threads and wait_policy_choice()[0])

    def before_stage(self) -> int:
        """The thread count for the stage that starts now."""
        return self.threads.adjust()

    def fix_threads(self) -> None:
        """Keep the thread count as it is from now on (a process whose share of the cores is fixed)."""
        self.threads.enabled = False

    @staticmethod
    def after_loading() -> None:
        release_freed_memory()

    @staticmethod
    def after_validation() -> None:
        release_freed_memory()

    @staticmethod
    def describe() -> str:
        """The thread count and the wait policy, with why (one console line)."""
        return f"threads: {torch.get_num_threads()}, {wait_policy_choice()[1]} (posttrain.host.threads)"
