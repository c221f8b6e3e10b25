"""Step metrics with verl's names, computed once per step from the batch (no `.item()` in the math).

`compute_data_metrics` mirrors verl's `compute_data_metrics`: sequence-level score/reward sums,
masked advantage/return/value statistics, response/prompt lengths and their clip ratios.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

import torch

from posttrain.algorithms import masked_mean
from posttrain.batch import Batch
from posttrain.host.resident import PhasePeaks


class StageTimer:
    """`with timer("gen"): ...` records `timing_s/gen`, and with ``memory`` (the run's `PhasePeaks`)
    this process's peak resident memory in the stage, `memory/resident_gb/gen`. ``before_stage``
    runs as each stage starts (the trainer's thread count, `posttrain.host.threads.FreeCoreThreads`)."""

    def __init__(self, memory: PhasePeaks | None = None, before_stage: Callable[[], Any] | None = None):
        self.seconds: dict[str, float] = {}
        self.memory = memory
        self.before_stage = before_stage

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.before_stage is not None and name != "step":  # "step" encloses the others
            self.before_stage()
        start = time.perf_counter()
        try:
            with self.memory(name) if self.memory is not None else nullcontext():
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        out = {f"timing_s/{k}": v for k, v in self.seconds.items()}
        return out | (self.memory.take_metrics() if self.memory is not None else {})


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(), f"{prefix}/min": values.min().item()}


def compute_data_metrics(batch: Batch, use_critic: bool) -> dict[str, float]:
    mask = batch["response_mask"].bool()
    prompt_mask = batch["attention_mask"][:, : -mask.shape[1]].bool()
    max_response, max_prompt = mask.shape[1], prompt_mask.shape[1]
    response_length = mask.sum(-1).float()
    prompt_length = prompt_mask.sum(-1).float()
    out = {
        **_stats("critic/score", batch["token_level_scores"].sum(-1)),
        **_stats("critic/rewards", batch["token_level_rewards"].sum(-1)),
        **_stats("critic/advantages", batch["advantages"][mask]),
        **_stats("critic/returns", batch["returns"][mask]),
        **_stats("response_length", response_length),
        **_stats("prompt_length", prompt_length),
        "response_length/clip_ratio": (response_length >= max_response).float().mean().item(),
        "prompt_length/clip_ratio": (prompt_length >= max_prompt).float().mean().item(),
    }
    if use_critic:
        values, returns = batch["values"][mask], batch["returns"][mask]
        out.update(_stats("critic/values", values))
        var_returns = returns.var(unbiased=False)
        out["critic/vf_explained_var"] = (1.0 - (returns - values).var(unbiased=False) / (var_returns + 1e-5)).item()
    return out


def rollout_actor_diff(batch: Batch) -> dict[str, float]:
    """|p_rollout - p_actor| on response tokens: engine/trainer mismatch shows here (verl #2996)."""
    if "rollout_log_probs" not in batch.batch.keys():
        return {}
    mask = batch["response_mask"].bool()
    diff = (batch["rollout_log_probs"].exp() - batch["old_log_probs"].exp()).abs()[mask]
    if diff.numel() == 0:
        return {}
    return {"training/rollout_actor_probs_diff_mean": diff.mean().item(),
            "training/rollout_actor_probs_diff_max": diff.max().item()}


def throughput(batch: Batch, step_seconds: float, world_size: int) -> dict[str, float]:
    tokens = batch["attention_mask"].sum().item()
    return {"perf/total_num_tokens": tokens, "perf/time_per_step": step_seconds,
            "perf/throughput": tokens / max(step_seconds, 1e-9) / world_size}


def mean_entropy(entropy: torch.Tensor | None, mask: torch.Tensor) -> dict[str, float]:
    """Entropy of the rollout policy on response tokens (computed with the old log-probs)."""
    if entropy is None:
        return {}
    return {"actor/entropy_rollout": masked_mean(entropy, mask.float()).item()}
