"""verl's `async_training.*` keys (its one-step-off and fully-async recipes) and their start-up checks.

Asynchronous rollouts are on when `actor_rollout_ref.hybrid_engine=False`: a pool of rollout workers
(`actor_rollout_ref.rollout.nnodes` x `actor_rollout_ref.rollout.n_gpus_per_node`, posttrain.distributed.
rollout_pool) generates while the trainer updates (posttrain.trainer.async_trainer). Staleness is counted
in weight versions (the number of weight pushes so far): a sample may lag the trainer by at most
ceil(staleness_threshold) versions, and the pool starts at most (1 + staleness_threshold) x
trigger_parameter_sync_step x require_batches train batches per sync window (verl's budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Iterable

from posttrain.config.actor_rollout_ref import _cfg

PAUSABLE_ENGINES: tuple[str, ...] = ("hf",)
"""Rollout engines that can pause a generation mid-sequence and resume it with new weights (verl's
partial rollout). The hf engine takes a push between two decoding steps and prefills its running rows
again under the new weights (`HFRolloutEngine.pause_point`); posttrain's in-process vLLM engine runs a
batch to the end in one blocking call, so it cannot."""


@_cfg()
class AsyncTrainingConfig:
    staleness_threshold: float = 0.1
    """Most weight versions a sample may lag the trainer: ceil(this) (0: synchronous; 0.1..1: one step off); also sizes the in-flight budget (1 + this) x trigger_parameter_sync_step x require_batches train batches. Used only with actor_rollout_ref.hybrid_engine=False."""
    trigger_parameter_sync_step: int = 1
    """Trainer updates between two weight pushes to the rollout workers (verl's fully-async yaml uses 4)."""
    require_batches: int = 1
    """Train batches per sync window in the in-flight budget (verl's factor); one trainer step still consumes data.train_batch_size prompts."""
    partial_rollout: bool = False
    """Pause generations at a weight push and resume them with the new weights (verl's yaml: True): the hf engine takes a push between two decoding steps, each token keeps the log-prob of the weights that sampled it, and a sample's age is that of its first token. The vllm engine cannot pause (refused); no effect with staleness_threshold=0."""
    use_rollout_log_probs: bool = True
    """The rollout's own log-probs are the PPO anchor (old_log_probs = rollout_log_probs; verl's bypass mode)."""
    compute_prox_log_prob: bool = False
    """Recompute old log-probs with the trainer's current weights and correct stale samples with algorithm.rollout_correction.* against the rollout's log-probs (AReaL's decoupled PPO)."""


V1_MODES = ("sync", "colocate_async", "separate_async")
"""``trainer.v1.trainer_mode``'s values (verl 0.9)."""


def apply_trainer_mode(config: Any) -> None:
    """verl 0.9's ``trainer.use_v1`` / ``trainer.v1.trainer_mode`` onto posttrain's runs, in place:

    - ``sync`` (and ``use_v1=False``): nothing changes (the colocated run, or whatever hybrid_engine says);
    - ``colocate_async``: the one-step-off run (a rollout pool one weight version behind, weights pushed after
      every update). verl keeps generation on the trainer's GPUs; posttrain's rollout pool is its own
      processes (``rollout.nnodes`` x ``rollout.n_gpus_per_node``, one worker when unset);
    - ``separate_async``: the fully-async run: weights pushed every ``v1.separate_async.parameter_sync_step``
      updates, samples at most ``v1.sampler.max_off_policy_threshold`` versions stale, partial rollouts where
      the engine can pause.

    An ``async_training.*`` key the user set (anything but its default) wins over the mode's value."""
    trainer = config.trainer
    mode = trainer.v1.trainer_mode if trainer.use_v1 else "sync"
    if mode not in V1_MODES or mode == "sync":
        return
    arr, cfg, default = config.actor_rollout_ref, config.async_training, AsyncTrainingConfig()
    arr.hybrid_engine = False
    if arr.rollout.n_gpus_per_node == 0:
        arr.rollout.n_gpus_per_node = 1
    if mode == "colocate_async":
        wanted = {"staleness_threshold": 1, "trigger_parameter_sync_step": 1}
    else:
        v1 = trainer.v1
        wanted = {"staleness_threshold": v1.sampler.max_off_policy_threshold,
                  "trigger_parameter_sync_step": v1.separate_async.parameter_sync_step,
                  "partial_rollout": arr.rollout.name in PAUSABLE_ENGINES}
    for name, value in wanted.items():
        if getattr(cfg, name) == getattr(default, name):
            setattr(cfg, name, value)


def async_enabled(config: Any) -> bool:
    """Separate rollout workers: ``actor_rollout_ref.hybrid_engine=False``."""
    return not config.actor_rollout_ref.hybrid_engine


def max_lag(staleness_threshold: float) -> int:
    """Weight versions a sample may lag the trainer: ceil(staleness_threshold)."""
    return int(math.ceil(staleness_threshold))


def window_batches(cfg: AsyncTrainingConfig) -> int:
    """Train batches the pool may start per sync window (verl's (1 + s) x sync steps x require_batches)."""
    return max(1, int(math.ceil((1 + cfg.staleness_threshold) * cfg.trigger_parameter_sync_step
                                * cfg.require_batches - 1e-9)))


def rollout_workers(config: Any) -> int:
    rollout = config.actor_rollout_ref.rollout
    return rollout.nnodes * rollout.n_gpus_per_node


def units_per_batch(config: Any) -> int:
    """Work units (of data.gen_batch_size prompts) per train batch: the pool streams units."""
    return config.data.train_batch_size // config.data.gen_batch_size


def _changed_async_keys(config: Any) -> list[str]:
    default, cfg = AsyncTrainingConfig(), config.async_training
    out = [f"async_training.{f.name}" for f in fields(cfg) if getattr(cfg, f.name) != getattr(default, f.name)]
    rollout = config.actor_rollout_ref.rollout
    out += [f"actor_rollout_ref.rollout.{k}" for k, d in (("n_gpus_per_node", 0), ("total_rollout_steps", None))
            if getattr(rollout, k) != d]
    return out


def async_problems(config: Any) -> Iterable[str]:
    """Start-up errors of the async keys, one line each naming the key and what is valid."""
    if not async_enabled(config):
        changed = _changed_async_keys(config)
        if changed:
            yield (f"{', '.join(changed)} set with actor_rollout_ref.hybrid_engine=True (one colocated engine, no "
                   "rollout pool): set actor_rollout_ref.hybrid_engine=False for asynchronous rollouts, or leave "
                   "these keys at their defaults")
        return
    yield from _value_problems(config)
    yield from _setup_problems(config)


def _value_problems(config: Any) -> Iterable[str]:
    cfg, rollout = config.async_training, config.actor_rollout_ref.rollout
    s = cfg.staleness_threshold
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
        yield (f"async_training.staleness_threshold={s!r} must be a finite number >= 0 (0: synchronous, 0.1..1: "
               "one step off, 2: two versions)")
    t = cfg.trigger_parameter_sync_step
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        yield f"async_training.trigger_parameter_sync_step={t!r} must be an integer >= 1 (updates between weight pushes)"
    r = cfg.require_batches
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        yield f"async_training.require_batches={r!r} must be an integer >= 1"
    for key in ("nnodes", "n_gpus_per_node"):
        value = getattr(rollout, key)
        if not isinstance(value, int) or value < 0:
            yield f"actor_rollout_ref.rollout.{key}={value!r} must be an integer >= 0"
    if rollout.total_rollout_steps is not None and (not isinstance(rollout.total_rollout_steps, int)
                                                    or rollout.total_rollout_steps < 1):
        yield (f"actor_rollout_ref.rollout.total_rollout_steps={rollout.total_rollout_steps!r} must be >= 1 "
               "(prompts to generate in the run) or null (from trainer.total_training_steps)")


def _setup_problems(config: Any) -> Iterable[str]:
    cfg, rollout = config.async_training, config.actor_rollout_ref.rollout
    if rollout_workers(config) == 0 or rollout.nnodes == 0:
        yield (f"actor_rollout_ref.hybrid_engine=False needs a rollout pool, but actor_rollout_ref.rollout.nnodes="
               f"{rollout.nnodes} x actor_rollout_ref.rollout.n_gpus_per_node={rollout.n_gpus_per_node} = 0 "
               "devices; set both >= 1 (on CPU: rollout workers, each on its own cores)")
    s = cfg.staleness_threshold
    if cfg.partial_rollout and isinstance(s, (int, float)) and s > 0 and rollout.name not in PAUSABLE_ENGINES:
        yield (f"async_training.partial_rollout=True needs an engine that can pause a generation at a weight push, "
               f"and actor_rollout_ref.rollout.name={rollout.name} cannot (engines that can: "
               f"{', '.join(PAUSABLE_ENGINES)}); set async_training.partial_rollout=False (finished samples only, "
               "dropped beyond the staleness bound) or actor_rollout_ref.rollout.name=hf")
    if not cfg.use_rollout_log_probs and not cfg.compute_prox_log_prob:
        yield ("async_training.use_rollout_log_probs=False and async_training.compute_prox_log_prob=False leave a "
               "stale sample without an old policy: set use_rollout_log_probs=True (rollout log-probs are the "
               "anchor) or compute_prox_log_prob=True (recomputed, corrected by algorithm.rollout_correction.*)")
    if not rollout.calculate_log_probs:
        yield ("actor_rollout_ref.rollout.calculate_log_probs=False with actor_rollout_ref.hybrid_engine=False: "
               "asynchronous rollouts need the rollout's own log-probs; set it to True")
    yield from _batch_problems(config)


def _batch_problems(config: Any) -> Iterable[str]:
    data = config.data
    if config.algorithm.filter_groups.enable:
        yield ("algorithm.filter_groups.enable=True with actor_rollout_ref.hybrid_engine=False: dynamic sampling "
               "is not supported with asynchronous rollouts yet; set one of them back")
    elif data.gen_batch_size < 1 or data.train_batch_size % data.gen_batch_size:
        yield (f"data.gen_batch_size={data.gen_batch_size} (prompts per rollout work unit) must divide "
               f"data.train_batch_size={data.train_batch_size}")


def async_warnings(config: Any) -> list[str]:
    cfg = config.async_training
    if async_enabled(config) and cfg.partial_rollout and cfg.staleness_threshold == 0:
        return ["async_training.partial_rollout=True has no effect with async_training.staleness_threshold=0 "
                "(no generation outlives a weight push)"]
    return []


@dataclass(frozen=True)
class AsyncBudget:
    """What the run's keys allow: the sample lag bound and the in-flight window, in work units."""

    max_lag: int
    window_batches: int
    units_per_batch: int
    sync_every: int

    @property
    def window_units(self) -> int:
        return self.window_batches * self.units_per_batch

    def describe(self) -> str:
        return (f"staleness budget: samples may lag <= {self.max_lag} weight version(s); weights pushed every "
                f"{self.sync_every} update(s); at most {self.window_batches} train batch(es) "
                f"({self.window_units} work unit(s)) started per sync window")


def async_budget(config: Any) -> AsyncBudget:
    cfg = config.async_training
    return AsyncBudget(max_lag(cfg.staleness_threshold), window_batches(cfg), units_per_batch(config),
                       cfg.trigger_parameter_sync_step)
