"""Asynchronous rollouts (``actor_rollout_ref.hybrid_engine=False``): a rollout pool generates while the
trainer updates; verl's one-step-off and fully-async recipes under their keys (`async_training.*`).

The step after generation is `RLTrainer.train_step`'s own code: only where a step's samples come from
differs (`_generate_and_score` takes them from the pool instead of generating). Per step:

    take the oldest open train batch's work units from the pool (submission order)
      -> drop units whose weight version lags the trainer's by more than ceil(staleness_threshold)
         (counted; their prompts are generated again) -> score -> RLTrainer.train_step's body
      -> every trigger_parameter_sync_step updates: push the weights (version += 1), then start the
         next sync window's train batches (at most (1 + s) x sync steps x require_batches in flight)

Old log-probs: ``use_rollout_log_probs`` -> the rollout's (pi_old = pi_rollout, verl's bypass);
``compute_prox_log_prob`` -> recomputed with the trainer's current weights, and
``algorithm.rollout_correction.*`` weighs or rejects tokens against the rollout's log-probs.

Checkpoints hold the trainer's state, ``weight_version`` and the loader position from before the oldest
train batch not yet trained on: in-flight samples are left out and generated again after a resume, so no
update is repeated or skipped. Resume pushes the restored weights to the pool first.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from posttrain.batch import Batch
from posttrain.config import ConfigError, PostTrainConfig, validate_config
from posttrain.config.async_training import async_budget, async_enabled, rollout_workers
from posttrain.rewards.manager import RewardInterrupted
from posttrain.rollout.multi_turn import multi_turn_columns
from posttrain.rollout.seeding import SEED_KEY, batch_seed
from posttrain.trainer import resume, setup
from posttrain.trainer.dynamic_sampling import concat_rounds
from posttrain.trainer.metrics import StageTimer
from posttrain.trainer.run import StepUndone
from posttrain.trainer.trainer import GREEDY_BASELINE_ESTIMATORS, RLTrainer

__all__ = ["AsyncRLTrainer", "split_by_lag"]

WEIGHT_VERSION_KEY = "async_weight_version"
_UNIT_META = ("weight_version", "weight_version_end", "rollout_worker", "rollout_busy_s", "rollout_wall_s")


def split_by_lag(sample_versions: list[int], trainer_version: int, bound: int) -> tuple[list[int], list[int]]:
    """(kept, dropped) indices: a sample is kept when trainer_version - its version <= bound."""
    kept = [i for i, v in enumerate(sample_versions) if trainer_version - v <= bound]
    return kept, [i for i in range(len(sample_versions)) if i not in kept]


class AsyncRLTrainer(RLTrainer):
    """`RLTrainer` with a separate rollout pool (see the module docstring). Same arguments, except that the
    actor must be loaded from ``actor_rollout_ref.model.path`` (the rollout workers load it too)."""

    def __init__(self, config: PostTrainConfig, *, actor_module: Any = None, critic_module: Any = None,
                 tokenizer: Any = None, reward_fn: Any = None):
        validate_config(config)
        _check_async_setup(config, actor_module)
        self.budget = async_budget(config)
        self.pool, device, trainer_cpus = _start_pool(config)
        ranks = setup.world_size(config) > 1  # the trainer's FSDP2 ranks are Ray actors of their own
        try:
            if device == "cuda" and not ranks:
                _use_gpu_left_by(self.pool)
            elif trainer_cpus and not ranks:
                import torch

                torch.set_num_threads(trainer_cpus)  # the cores the rollout workers leave
            super().__init__(config, actor_module=actor_module, critic_module=critic_module, tokenizer=tokenizer,
                             reward_fn=reward_fn)
            # the weights go from this process's actor, or from the ranks (rank 0 sends what all of them gather)
            self._weights = self.workers if ranks else self.workers.actor.module
            self.pool.connect_weights(self._weights, timeout_s=float(config.actor_rollout_ref.nccl_timeout))
        except BaseException:
            self.pool.shutdown()
            raise
        self.host.fix_threads()  # this process's share is fixed: the pool's workers hold the rest
        print(_describe_pool(self.pool, device, trainer_cpus), flush=True)
        print(self.budget.describe(), flush=True)
        source = "recompute" if config.async_training.compute_prox_log_prob else "rollout"
        self.sizes = dataclasses.replace(self.sizes, old_log_probs_from=source)
        self.weight_version = 0
        self.lora_only = (config.actor_rollout_ref.model.lora_rank > 0 if ranks
                          else getattr(self.workers.actor, "lora", None) is not None)
        self._open: OrderedDict[int, dict] = OrderedDict()  # train batch id -> loader state before, unit seqs
        self._next_batch_id = 0
        self._primed = False
        self._counts = {"stale_samples_processed": 0, "stale_samples_dropped": 0, "partial_rollout_samples": 0}
        self.samples_used: list[Batch] | None = None  # set to [] to record each step's samples (replay tests)

    # ------------------------------------------------------------------ the window
    def _refill(self, finished_steps: int) -> None:
        """Start train batches until the sync window's budget is in flight (none past the run's last step)."""
        loader = self.data.train_loader
        cfg = self.config
        while len(self._open) < self.budget.window_batches and finished_steps + len(self._open) < self.total_steps:
            step = finished_steps + len(self._open) + 1  # the training step this batch is for
            state = loader.state_dict()
            prompts = loader.next_batch()
            bid, self._next_batch_id = self._next_batch_id, self._next_batch_id + 1
            prompts.meta_info["temperature"] = cfg.actor_rollout_ref.rollout.temperature
            prompts.non_tensor_batch["uid"] = np.array([f"b{bid}-p{i}" for i in range(len(prompts))], dtype=object)
            units = prompts.split(cfg.data.gen_batch_size)
            for k, unit in enumerate(units):
                unit.meta_info = dict(unit.meta_info)  # split's parts share one dict
                if cfg.actor_rollout_ref.rollout.seed_per_batch:  # as RLTrainer seeds this step's prompts
                    unit.meta_info[SEED_KEY] = batch_seed(cfg.trainer.seed, step, k * cfg.data.gen_batch_size)
            self._open[bid] = {"state": state, "seqs": [self.pool.submit(u, (bid, u)) for u in units]}

    def _take_batch(self, timer: StageTimer) -> Batch:
        """The oldest open train batch's samples; stale units are dropped, counted and generated again."""
        entry = next(iter(self._open.values()))
        parts = []
        with timer("wait_rollout"):
            for seq in entry["seqs"]:
                parts.append(self._take_fresh(seq))
        self.last_sample_versions = [p.meta_info["weight_version"] for p in parts]
        for part in parts:
            for key in _UNIT_META:
                part.meta_info.pop(key, None)
        return concat_rounds(parts, self.data.train.pad_token_id)

    def _take_fresh(self, seq: int) -> Batch:
        while True:
            batch, tag, _ = self.pool.take(seq)
            kept, dropped = split_by_lag([batch.meta_info["weight_version"]], self.weight_version, self.budget.max_lag)
            if kept:
                if batch.meta_info["weight_version"] < self.weight_version:
                    self._counts["stale_samples_processed"] += len(batch)
                if batch.meta_info.get("weight_version_end", 0) > batch.meta_info["weight_version"]:
                    self._counts["partial_rollout_samples"] += len(batch)  # a push landed mid-generation
                return batch
            self._counts["stale_samples_dropped"] += len(batch)
            seq = self.pool.submit(tag[1], tag)

    # ------------------------------------------------------------------ one step
    def _generate_and_score(self, prompts: Any, timer: StageTimer, first_uid: int = 0) -> tuple[Batch, dict]:
        """The pool's samples for this step, scored as `RLTrainer` scores its own."""
        batch = self._take_batch(timer)
        if self.samples_used is not None:
            self.samples_used.append(copy.deepcopy(batch))
        with timer("reward"):
            batch["token_level_scores"], extra = self._score(batch)
            extra.update(multi_turn_columns(batch))
        return batch, extra

    def step(self) -> dict[str, float]:
        start = time.perf_counter()
        self.workers.mark_step()
        if not self._primed:
            self._refill(self.global_step - 1)
            self._primed = True
        self._counts = dict.fromkeys(self._counts, 0)
        try:
            metrics = self.train_step(None)  # the prompts were drawn when their batch was started
        except RewardInterrupted as stop:
            raise StepUndone() from stop  # no weight changed; the batch stays open, a save regenerates it
        self._open.popitem(last=False)
        if self.global_step % self.budget.sync_every == 0:
            metrics.update(self._push())
            self._refill(self.global_step)
        wait, seconds = metrics.get("timing_s/wait_rollout", 0.0), max(time.perf_counter() - start, 1e-9)
        metrics.update({f"fully_async/count/{k}": float(v) for k, v in self._counts.items()})
        metrics.update(self.pool.metrics())
        # samples_per_s: responses trained on over the step's wall time (waiting for the pool and the push
        # included), the figure benchmarks/bench_async.py sets against the colocated run
        samples = self.config.data.train_batch_size * self.config.actor_rollout_ref.rollout.n
        metrics.update({"trainer/idle_ratio": wait / seconds, "perf/samples_per_s": samples / seconds,
                        "weight_sync/version": float(self.weight_version)})
        return metrics

    def _push(self) -> dict[str, float]:
        start = time.perf_counter()
        sent = self.pool.push(self._weights, self.weight_version + 1, self.lora_only)
        self.weight_version += 1
        return {"weight_sync/seconds": time.perf_counter() - start,
                **{k: float(v) for k, v in (sent or {}).items() if k != "weight_sync/seconds"}}

    def _total_steps(self) -> int:
        rollout_prompts = self.config.actor_rollout_ref.rollout.total_rollout_steps
        if self.config.trainer.total_training_steps is None and rollout_prompts is not None:
            return max(1, math.ceil(rollout_prompts / self.config.data.train_batch_size))
        return super()._total_steps()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self):
        """The trainer's state, the weight version and the loader position before the oldest open batch."""
        loader = self.data.train_loader
        now = loader.state_dict()
        if self._open:
            loader.load_state_dict(next(iter(self._open.values()))["state"])
        try:
            extra = {"global_step": self.global_step, "train_loader": loader.state_dict(),
                     "kl_ctrl": self.kl_ctrl.state_dict() if self.kl_ctrl is not None else None,
                     "nonfinite_streak": self._nonfinite_streak, WEIGHT_VERSION_KEY: self.weight_version,
                     resume.FIRST_VALIDATION_KEY: self.first_validation, resume.FINGERPRINT_KEY: self.fingerprint()}
            return self.checkpoints.save(self.global_step, self.workers.save_checkpoint, extra)
        finally:
            loader.load_state_dict(now)

    def restore(self):
        from posttrain.checkpoint.layout import read_run_state

        path = resume.resolve_resume(self.config.trainer)
        version = read_run_state(path).extra.get(WEIGHT_VERSION_KEY, 0) if path is not None else 0
        run = super().restore()
        if run is not None:  # the workers loaded the initial weights: they get the restored ones
            self.weight_version = int(version) - 1
            self._push()
        return run

    def fit(self) -> list[dict[str, float]]:
        try:
            return super().fit()
        finally:
            self.pool.shutdown()

    def close(self) -> None:
        """End the rollout workers (`fit` does it when it returns)."""
        self.pool.shutdown()


def _describe_pool(pool: Any, device: str, trainer_cpus: int | None) -> str:
    where = "; ".join(f"rollout worker {i.index} pid {i.pid} node {i.ip}" for i in pool.info)
    share = f", the trainer keeps {trainer_cpus} core(s)" if trainer_cpus else ""
    return f"rollout pool: {len(pool.info)} worker(s) on {device}{share}: {where}"


def _check_async_setup(config: PostTrainConfig, actor_module: Any) -> None:
    if not async_enabled(config):
        raise ConfigError("the asynchronous trainer needs actor_rollout_ref.hybrid_engine=False")
    if actor_module is not None:
        raise ConfigError("asynchronous rollouts load the actor in each rollout worker from "
                          "actor_rollout_ref.model.path: save the in-memory model and set that key")
    if config.algorithm.adv_estimator in GREEDY_BASELINE_ESTIMATORS:
        raise ConfigError(f"algorithm.adv_estimator={config.algorithm.adv_estimator} scores a greedy response "
                          "generated with the trainer's weights; not supported with actor_rollout_ref."
                          "hybrid_engine=False yet (use grpo, rloo, reinforce_plus_plus, gae)")


def _start_pool(config: PostTrainConfig):
    """Connect Ray, check that trainer + rollout devices fit the cluster, start the pool.
    Returns (pool, device, trainer CPU share or None on GPU)."""
    from posttrain.distributed.cluster import ClusterResourceError, check_resources, connect
    from posttrain.distributed.rollout_pool import RolloutPool, cpu_share

    device = setup.resolve_device(config).type
    rollout, k = config.actor_rollout_ref.rollout, rollout_workers(config)
    trainer_devices = setup.world_size(config)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = cpu_share(cores, trainer_devices, k) if device == "cpu" else 1
    init = {key: getattr(config.ray_kwargs.ray_init, key) for key in ("num_cpus", "runtime_env")}
    connect(init, device)
    on_driver_node = trainer_devices if rollout.nnodes == 1 else 0
    try:
        check_resources(rollout.nnodes, rollout.n_gpus_per_node + on_driver_node, device, cpus_per_rank=share)
    except ClusterResourceError as err:
        raise ClusterResourceError(
            f"actor_rollout_ref.rollout.nnodes={rollout.nnodes} x actor_rollout_ref.rollout.n_gpus_per_node="
            f"{rollout.n_gpus_per_node} rollout workers plus {trainer_devices} trainer device(s) on {device} do not "
            f"fit the Ray cluster ({' '.join(str(err).split())})") from None
    pool = RolloutPool(config, k, device, share, start_timeout_s=float(config.trainer.ray_wait_register_center_timeout))
    return pool, device, share * trainer_devices if device == "cpu" else None


def _use_gpu_left_by(pool: Any) -> None:
    """The trainer computes on a visible GPU that no rollout worker was given."""
    import torch

    taken = {g for info in pool.info for g in info.gpu_ids}
    free = [i for i in range(torch.cuda.device_count()) if str(i) not in taken]
    if not free:
        raise ConfigError("every visible GPU went to a rollout worker; lower actor_rollout_ref.rollout.n_gpus_per_node "
                          "so the trainer keeps one")
    torch.cuda.set_device(free[0])
