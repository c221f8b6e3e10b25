"""How this process was launched: as one of several ranks that ``torchrun`` started, and how many.

On the ground floor (it imports nothing from posttrain) because the config checks need the rank
count (SFT/DPO batch sizes must divide by it) as much as the torchrun worker group does, and
config may not import distributed code.
"""

from __future__ import annotations

import os

__all__ = ["launched_by_torchrun", "torchrun_world_size"]


def launched_by_torchrun() -> bool:
    """True in a process that torchrun (torch.distributed.run) started as one of several ranks."""
    return "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def torchrun_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
