"""Per-batch sampling seeds (``actor_rollout_ref.rollout.seed_per_batch``).

By default every process samples from its own torch random stream: the colocated trainer from the stream
``trainer.seed`` started, an asynchronous rollout worker from ``trainer.seed + 1 + index``. Two runs of the
same algorithm that differ only in where rollouts run then draw different random numbers, and a 4-step
run's held-out accuracy moves by several points with the draw (benchmarks/README.md, "Asynchronous
rollouts"), which hides whatever the placement itself changes.

With per-batch seeds the trainer (or the async trainer, when it starts a work unit) writes a seed into the
prompts' ``meta_info``, derived from ``trainer.seed``, the training step the batch is for and the offset of
its first prompt within that step; the actor samples under it (`seeded_sampling`) and leaves the process's
own stream as it was. The same batch then draws the same numbers wherever it is generated.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import torch

from posttrain.checkpoint.ranks import process_rank

__all__ = ["SEED_KEY", "batch_seed", "seeded_sampling"]

SEED_KEY = "sampling_seed"


def batch_seed(run_seed: int, step: int, first_prompt: int) -> int:
    """A 63-bit seed for the prompts starting at ``first_prompt`` of training step ``step``."""
    state = np.random.SeedSequence([int(run_seed) & 0xFFFFFFFF, int(step), int(first_prompt)]).generate_state(2)
    return int((int(state[0]) << 31) ^ int(state[1]))


@contextlib.contextmanager
def seeded_sampling(meta_info: dict[str, Any]) -> Iterator[None]:
    """Sample under ``meta_info[SEED_KEY]`` (offset by this rank: ranks get different prompts and should not
    share their draws), restoring the process's random state after; nothing happens without the key."""
    seed = meta_info.get(SEED_KEY)
    if seed is None:
        yield
        return
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed((int(seed) + process_rank()) % (1 << 63))
        yield
