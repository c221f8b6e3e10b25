"""`RankWorkerGroup`: the `WorkerGroup` the trainer talks to when a run has several ranks.

Each call splits the driver's batch over the ``W`` data-parallel ranks (rows reordered first so
every rank gets a similar number of tokens, when ``trainer.balance_batch``; padded to a multiple of
``W``; padding rows carry a zero response mask in updates, so they count in no loss), runs the
same method of every rank's `RankWorker` through Ray, and gathers the results back in the
driver's row order. Update metrics are combined per metric kind (`dispatch.combine_metrics`).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain.agents.rollout import gather_agent_batches, is_agent_batch
from posttrain.batch import Batch
from posttrain.distributed.split import (balance_batch, combine_metrics, gather_from_ranks, inverse_permutation,
                                            split_for_ranks, split_update)
from posttrain.workers.group import Call, bind_calls

__all__ = ["RankWorkerGroup"]


@bind_calls
class RankWorkerGroup:
    """``trainer.nnodes x trainer.n_gpus_per_node`` ranks placed by Ray, each a `RankWorker`.

    Args:
        config: the run config (`trainer.*`, `ray_kwargs.*` are read here).
        specs: the roles every rank builds, with per-rank batch sizes (`posttrain.config.roles.RoleSpecs`).
        seed, tokenizer: handed to every rank.
    """

    writes = True  # the driver (the ranks write their shards into the checkpoints it seals)

    def __init__(self, config: Any, specs: Any, seed: int, tokenizer: Any):
        from omegaconf import OmegaConf

        from posttrain.distributed.cluster import connect, resolve_device
        from posttrain.distributed.rank import RankWorker
        from posttrain.distributed.ray_pool import RayActorPool

        t = config.trainer
        device = resolve_device(t.device)
        ray_init = OmegaConf.to_container(OmegaConf.structured(config.ray_kwargs.ray_init), resolve=True)
        connect(ray_init, device)
        self._ranks = RayActorPool(RankWorker, (specs, seed, tokenizer, device), nnodes=t.nnodes,
                                     n_gpus_per_node=t.n_gpus_per_node, device=device,
                                     placement_timeout_s=t.ray_wait_register_center_timeout)
        self.world_size, self.seed = self._ranks.world_size, seed
        self.has_ref, self.has_critic, self.has_rm = (specs.ref is not None, specs.critic is not None,
                                                      specs.rm is not None)
        self.has_teacher = getattr(specs, "teachers", None) is not None
        self.balance = bool(t.balance_batch)
        if t.save_freq > 0 or t.resume_mode != "disable":
            self.check_shared_folder(Path(t.default_local_dir).expanduser(), "trainer.default_local_dir")

    # ---------------------------------------------------------------- asynchronous rollouts: the weight sender
    def weight_sync_address(self) -> tuple[str, int]:
        """Where rank 0 hosts the rollout workers' weight-sync rendezvous (its node's IP, a free port there)."""
        return self._ranks.call_all("weight_sync_address")[0]

    def join_weight_sync(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        """Rank 0 joins the weight-sync group as its sender (the rollout workers join beside it)."""
        self._ranks.call_each("join_weight_sync", [r == 0 for r in range(self.world_size)], host, port, world_size,
                              backend, timeout_s)

    def push_weights(self, version: int, lora_only: bool) -> dict[str, float]:
        """The actor's full weights (the LoRA adapter alone with ``lora_only``), gathered on every rank and
        sent by rank 0 as ``version``; rank 0's send metrics."""
        return self._ranks.call_all("push_weights", version, lora_only)[0]

    def check_shared_folder(self, folder: Path, key: str) -> None:
        """Every rank writes its checkpoint shards into ``folder``, and the driver seals them: refuse to
        start unless every rank sees a file the driver writes there (a filesystem all nodes mount)."""
        from posttrain.config import ConfigError

        try:
            folder.mkdir(parents=True, exist_ok=True)
            marker = folder / f".posttrain_shared_check_{uuid.uuid4().hex}"
            token = uuid.uuid4().hex
            marker.write_text(token)
        except OSError as err:
            raise ConfigError(f"{key}={folder}: cannot write there ({err.strerror or err}); choose a writable "
                              "folder that every node mounts") from None
        try:
            seen = self._ranks.call_all("sees_file", str(marker), token)
        finally:
            marker.unlink(missing_ok=True)
        problem = unshared_ranks_message(self._ranks.ranks, seen, folder, key)
        if problem:
            raise ConfigError(problem)

    # ------------------------------------------------------------------ data-parallel calls (CALLS)
    def _dispatch(self, name: str, call: Call, batch: Batch, **options: Any) -> Any:
        if call.split == "prompts":
            chunks, pad = split_for_ranks(batch, self.world_size)
            outs = self._ranks.call_each(name, chunks, **options)
            if is_agent_batch(outs[0]):  # agent episodes: a prompt's rows vary (splits), prompt widths too
                return gather_agent_batches(outs, len(chunks[0]), pad)
            samples = len(outs[0]) // len(chunks[0])  # responses per prompt (n)
            return gather_from_ranks(outs, pad * samples)
        if call.split == "update":
            return combine_metrics(self._ranks.call_each(name, self._update_chunks(batch, options), **options))
        batch, perm = self._balanced(batch)
        chunks, pad = split_for_ranks(batch, self.world_size)
        return _unpermute(gather_from_ranks(self._ranks.call_each(name, chunks, **options), pad), perm)

    def _update_chunks(self, batch: Batch, options: dict[str, Any]) -> list[Batch]:
        """Rows balanced by tokens over the ranks; an objective's pairs stay whole and in order instead
        (padded with zero-weight pairs to a multiple of 2 x ranks rows: no balancing, which would split them)."""
        pairs = bool(getattr(options.get("objective"), "pairs", False))
        if not pairs:
            batch, _ = self._balanced(batch)
        return split_update(batch, self.world_size, pairs)

    def _balanced(self, batch: Batch) -> tuple[Batch, np.ndarray | None]:
        if not self.balance or self.world_size == 1 or "attention_mask" not in batch:
            return batch, None
        batch = Batch.concat([batch])  # a copy: the caller's batch keeps its order
        return batch, balance_batch(batch, self.world_size)

    def memory_metrics(self) -> dict[str, float]:
        """Each rank's peak resident memory: per phase since the last call, the largest over ranks
        (``memory/ranks/resident_gb/<phase>``), and each rank's peak so far (``memory/rank<i>/peak_resident_gb``;
        ``memory/ranks/peak_resident_gb`` the largest). The driver's own are the trainer's ``memory/*``."""
        out: dict[str, float] = {}
        for rank, metrics in enumerate(self._ranks.call_all("memory_metrics")):
            for key, gb in metrics.items():
                if key == "memory/peak_resident_gb":
                    out[f"memory/rank{rank}/peak_resident_gb"] = gb
                wide = key.replace("memory/", "memory/ranks/", 1)
                out[wide] = max(out.get(wide, 0.0), gb)
        return out

    def save_checkpoint(self, folder: Path) -> list[str]:
        return self._ranks.call_all("save_checkpoint", str(folder))[0]

    def load_checkpoint(self, folder: Path) -> list[str]:
        """Every rank loads its shards and its own random state; what became of each rank's random state."""
        return self._ranks.call_all("load_checkpoint", str(folder))

    def mark_step(self) -> None:
        self._ranks.call_all("mark_step")

    def rewind_step(self) -> None:
        self._ranks.call_all("rewind_step")

    def agree_stop(self, stop: bool) -> bool:
        return stop  # the driver alone runs the loop

    def shutdown(self) -> None:
        self._ranks.shutdown()


def unshared_ranks_message(ranks: list[Any], seen: list[bool], folder: Path, key: str) -> str | None:
    """The error for ranks (`RankInfo`) that could not read the driver's marker file, or None."""
    blind = [info for info, ok in zip(ranks, seen) if not ok]
    if not blind:
        return None
    where = ", ".join(f"rank {i.rank} on {i.hostname} ({i.ip})" for i in blind)
    return (f"{key}={folder} is not shared by all nodes: {where} cannot see a file the driver wrote there. "
            "Every rank writes its checkpoint shards into that folder; put it on a filesystem every node mounts "
            "(NFS, Lustre, a cloud bucket mount)")


def _unpermute(out: Any, perm: np.ndarray | None) -> Any:
    if perm is None or out is None:
        return out
    inv = torch.as_tensor(inverse_permutation(perm))
    if isinstance(out, (tuple, list)):
        return type(out)(_unpermute(o, perm) for o in out)
    return out[inv]
