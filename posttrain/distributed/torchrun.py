"""`TorchrunGroup`: the worker group of an SFT or DPO run launched by ``torchrun`` (verl's SFT launch).

``torchrun --nproc_per_node=N -m posttrain.trainer.fsdp_sft_trainer ...`` starts N processes that are
all ranks of one run: each builds a `RankWorker` (the FSDP2-sharded actor, the reference when DPO
needs one) and runs the same driver loop on the same data. Each call takes this rank's share of the
batch (the split the Ray group makes: contiguous chunks, padding rows that train nothing, DPO pairs
kept whole), runs it on the rank's worker and all-gathers the results, so every rank's loop sees the
whole result, as one process does.

Only rank 0 writes what one driver writes: it locks the checkpoint folder, seals each checkpoint
(every rank writes its shards into the folder rank 0 names), logs metrics and exports; the ranks
agree on stopping after each step, so a signal that reaches one rank first stops all at the same step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.batch import Batch
from posttrain.distributed.split import combine_metrics, gather_from_ranks, split_for_ranks, split_update
from posttrain.workers.group import Call, bind_calls
from posttrain.launch import launched_by_torchrun, torchrun_world_size  # re-exported: their home is the ground floor

__all__ = ["TorchrunGroup", "first_rank_says", "launched_by_torchrun", "torchrun_world_size"]


def device_type_for(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def join(device: str, timeout_s: float) -> tuple[int, int]:
    """Join torchrun's process group (gloo on CPU, NCCL on GPUs); ``(rank, world size)``."""
    from posttrain.distributed.fsdp import backend_for, init_distributed

    return init_distributed(backend_for(device_type_for(device)), timeout_s=timeout_s)


def first_rank_says(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (before the group exists too: the checkpoint folder's verdict)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@bind_calls
class TorchrunGroup:
    """The `WorkerGroup` SFT and DPO calls on torchrun ranks (module docstring).

    Args: the role specs (`posttrain.config.roles.RoleSpecs`, per-rank sizes), the seed, the tokenizer,
    ``trainer.device``.
    """

    def __init__(self, specs: Any, seed: int, tokenizer: Any, device: str):
        from posttrain.distributed.rank import RankWorker

        self.worker = RankWorker(specs, seed, tokenizer, device_type_for(device))
        self.rank, self.world_size, self.seed = dist.get_rank(), dist.get_world_size(), seed
        self.has_ref, self.has_critic, self.has_rm = self.worker.ref is not None, False, False

    # ------------------------------------------------------------------ helpers
    def _gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def _dispatch(self, name: str, call: Call, batch: Batch, **options: Any) -> Any:
        """A call of `CALLS` on this rank's share of ``batch``; every rank gets the whole result."""
        if call.split == "update":
            pairs = bool(getattr(options.get("objective"), "pairs", False))
            chunk = split_update(batch, self.world_size, pairs)[self.rank]
            return combine_metrics(self._gather(getattr(self.worker, name)(chunk, **options)))
        chunks, pad = split_for_ranks(batch, self.world_size)
        outs = self._gather(getattr(self.worker, name)(chunks[self.rank], **options))
        samples = len(outs[0]) // len(chunks[0]) if call.split == "prompts" else 1  # responses per prompt
        return gather_from_ranks(outs, pad * samples)

    @property
    def writes(self) -> bool:
        return self.rank == 0

    def agree_stop(self, stop: bool) -> bool:
        """Whether ``stop`` is set on any rank (the ranks stop after the same step)."""
        value = torch.tensor([1.0 if stop else 0.0])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def first_rank_says(self, value: Any) -> Any:
        return first_rank_says(value)

    # ------------------------------------------------------------------ the calls
    def save_checkpoint(self, folder: Path) -> list[str]:
        """On rank 0, from the checkpoint manager: every rank writes its shards into ``folder``."""
        self.first_rank_says(str(folder))
        return self._write(str(folder))

    def follow_save(self) -> None:
        """On the other ranks, while rank 0 saves: write this rank's shards where rank 0 says."""
        self._write(self.first_rank_says(None))

    def _write(self, folder: str) -> list[str]:
        roles = self.worker.save_checkpoint(folder)
        dist.barrier()  # every shard is on disk before rank 0 seals the folder
        return roles

    def load_checkpoint(self, folder: Path) -> str:
        """This rank's share of the checkpoint. A failure on any rank (e.g. a refused ``rng/rank_1.pt``)
        stops every rank here with that rank's message: otherwise the others would train on and wait in
        their next collective, while the failed rank waits at the shutdown barrier, until the time-out."""
        from posttrain.checkpoint import CheckpointError
        from posttrain.errors import PosttrainError

        try:
            result, failure = self.worker.load_checkpoint(str(folder)), None
        except Exception as err:  # reported to every rank below; the gather must run on each of them
            result, failure = None, str(err) if isinstance(err, PosttrainError) else f"{type(err).__name__}: {err}"
        failed = [(rank, text) for rank, text in enumerate(self._gather(failure)) if text is not None]
        if failed:
            rank, text = failed[0]
            raise CheckpointError(f"resuming from {folder} failed on rank {rank} of {self.world_size}: {text}")
        return result

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
