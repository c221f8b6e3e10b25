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

A rank that ends mid-run (killed, out of memory) breaks the others' next collective with a transport
error (gloo: "Connection reset by peer"). Each survivor then stops with one line, `RankLost`, naming the
rank that is gone (found by the survivors checking in with the launcher's store) and skips the shutdown
barrier that could only fail again.
"""

from __future__ import annotations

import functools
import re
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from posttrain.batch import Batch
from posttrain.errors import CheckpointError, PosttrainError
from posttrain.distributed.split import combine_metrics, gather_from_ranks, split_for_ranks, split_update
from posttrain.workers.group import Call, bind_calls
from posttrain.launch import launched_by_torchrun, torchrun_world_size  # re-exported: their home is the ground floor

__all__ = ["RankLost", "TorchrunGroup", "first_rank_says", "launched_by_torchrun", "lost_ranks", "torchrun_world_size"]

# What a collective raises when a peer's process is gone or its connection closed (gloo's and NCCL's words).
_PEER_GONE = re.compile(r"connection (reset|closed) by peer|read error|write error|broken pipe|socket closed|"
                        r"remote process exited|communicator was aborted|timed out", re.I)
CHECK_IN_S = 5.0
"""How long a survivor waits for the other survivors to check in before naming the ranks that did not."""


class RankLost(PosttrainError):
    """A torchrun rank ended (or stopped answering) during a run; every survivor stops with this one line."""


def lost_ranks(rank: int, world_size: int, wait_s: float = CHECK_IN_S) -> list[int] | None:
    """The ranks that are gone, seen from a survivor of a failed collective: each survivor checks in with the
    process group's store (torchrun's agent holds it, so it outlives any rank) and those that never do are
    gone. None when the store cannot say (it was held by the lost rank)."""
    key = "posttrain/alive/{}".format
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(key(rank), "1")
        deadline = time.monotonic() + wait_s
        while True:
            present = {r for r in range(world_size) if store.check([key(r)])}
            if len(present) >= world_size - 1 or time.monotonic() > deadline:  # one rank lost: the usual case
                return [r for r in range(world_size) if r not in present]
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - a store that went with the lost rank: say so without naming it
        return None


def _stops_if_a_rank_is_lost(what: str) -> Callable:
    """Decorate a `TorchrunGroup` method that runs collectives: a peer's loss becomes `RankLost`."""
    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def run(self: "TorchrunGroup", *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except RuntimeError as err:
                if not _PEER_GONE.search(str(err)):
                    raise
                self.lost = True
                raise RankLost(self.lost_message(args[0] if what == "{call}" else what)) from None
        return run
    return wrap


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
        self.lost = False
        """A rank was lost (`RankLost`): the shutdown barrier is skipped."""

    def lost_message(self, during: str) -> str:
        gone = lost_ranks(self.rank, self.world_size)
        who = ("a rank" if not gone else "rank " + ", ".join(map(str, gone)) if len(gone) == 1
               else "ranks " + ", ".join(map(str, gone)))
        return (f"{who} of {self.world_size} ended or stopped answering during {during} (rank {self.rank} saw its "
                f"connection close); rank {self.rank} stops too: {'its' if gone and len(gone) == 1 else 'their'} own "
                "output says why (killed, out of memory, an error)")

    # ------------------------------------------------------------------ helpers
    @_stops_if_a_rank_is_lost("a gather of results")
    def _gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    @_stops_if_a_rank_is_lost("{call}")
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

    @_stops_if_a_rank_is_lost("the ranks' agreement to stop")
    def agree_stop(self, stop: bool) -> bool:
        """Whether ``stop`` is set on any rank (the ranks stop after the same step)."""
        value = torch.tensor([1.0 if stop else 0.0])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    @_stops_if_a_rank_is_lost("a broadcast from rank 0")
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

    @_stops_if_a_rank_is_lost("a checkpoint save")
    def _write(self, folder: str) -> list[str]:
        roles = self.worker.save_checkpoint(folder)
        dist.barrier()  # every shard is on disk before rank 0 seals the folder
        return roles

    def load_checkpoint(self, folder: Path) -> str:
        """This rank's share of the checkpoint. A failure on any rank (e.g. a refused ``rng/rank_1.pt``)
        stops every rank here with that rank's message: otherwise the others would train on and wait in
        their next collective, while the failed rank waits at the shutdown barrier, until the time-out."""
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
        if not dist.is_initialized():
            return
        if not getattr(self, "lost", False):  # a lost rank never reaches the barrier: it would fail again
            dist.barrier()
        dist.destroy_process_group()
