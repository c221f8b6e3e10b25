"""Staleness bound and off-policy correction of asynchronous rollouts against a hand-computed case (issue 39).

Trainer at weight version 2, bound ceil(staleness_threshold=1) = 1; a train batch of two work units
arrives as: unit A generated at version 1 (lag 1: kept, counted stale), unit B at version 0 (lag 2:
dropped, counted, its prompts generated again) and B's regeneration at version 2 (lag 0). With
compute_prox_log_prob the trainer recomputes the old log-probs and token TIS weighs each token by
min(exp(old - rollout), 2): the rollout log-probs of A are shifted by -1.5 (weight e^1.5 = 4.48 ->
clamped to 2) and of B's regeneration by +1.0 (weight e^-1 = 0.368).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import OrderedDict

import numpy as np
import torch

from helpers.tiny_run import tiny_config
from posttrain.config.async_training import AsyncBudget
from posttrain.trainer.async_trainer import AsyncRLTrainer, split_by_lag
from posttrain.trainer.trainer import RLTrainer


def test_split_by_lag_hand_case():
    assert split_by_lag([2, 1, 0], trainer_version=2, bound=1) == ([0, 1], [2])
    assert split_by_lag([2, 1, 0], trainer_version=2, bound=2) == ([0, 1, 2], [])
    assert split_by_lag([3], trainer_version=3, bound=0) == ([0], [])
    assert split_by_lag([2], trainer_version=3, bound=0) == ([], [0])


class ScriptedPool:
    """Stands in for the rollout pool: unit results by sequence number, resubmissions recorded."""

    def __init__(self, results: dict, tags: dict):
        self.results, self.submitted, self.tags = results, [], dict(tags)

    def submit(self, prompts, tag):
        seq = 2 + len(self.submitted)
        self.submitted.append(prompts)
        self.tags[seq] = tag
        return seq

    def take(self, seq):
        return self.results[seq], self.tags[seq], 0.0

    def metrics(self):
        return {}


def _unit(trainer, prompts, version: int, shift: float):
    batch = trainer.workers.generate_sequences(prompts)
    mask = batch["response_mask"].float()
    batch["rollout_log_probs"] = batch["rollout_log_probs"] + shift * mask
    batch.meta_info.update(weight_version=version, rollout_worker=0, rollout_busy_s=0.0, rollout_wall_s=0.0)
    return batch


def test_drops_counts_and_tis_weights_hand_case(tmp_path):
    sync = RLTrainer(tiny_config(tmp_path, ["algorithm.rollout_correction.rollout_is=token",
                                            "algorithm.rollout_correction.rollout_is_threshold=2.0"]))
    prompts = sync.data.train_loader.next_batch()
    prompts.meta_info["temperature"] = 1.0
    prompts.non_tensor_batch["uid"] = np.array([f"p{i}" for i in range(len(prompts))], dtype=object)
    unit_a, unit_b = prompts.split(2)
    results = {0: _unit(sync, unit_a, version=1, shift=-1.5), 1: _unit(sync, unit_b, version=0, shift=0.0),
               2: _unit(sync, unit_b, version=2, shift=1.0)}

    trainer = AsyncRLTrainer.__new__(AsyncRLTrainer)
    trainer.__dict__.update(sync.__dict__)
    trainer.sizes = dataclasses.replace(sync.sizes, old_log_probs_from="recompute")  # compute_prox_log_prob=True
    trainer.budget = AsyncBudget(max_lag=1, window_batches=1, units_per_batch=2, sync_every=1)
    trainer.pool = ScriptedPool(results, {0: (0, unit_a), 1: (0, unit_b)})
    trainer.weight_version, trainer.samples_used, trainer._primed = 2, None, True
    trainer._counts = {"stale_samples_processed": 0, "stale_samples_dropped": 0}
    trainer._open = OrderedDict({0: {"state": None, "seqs": [0, 1]}})
    trainer._push, trainer._refill = (lambda: {}), (lambda finished: None)
    trainer.global_step = 1

    began = time.perf_counter()
    metrics = trainer.step()
    wall = time.perf_counter() - began
    rows = len(results[0])  # responses per unit (2 prompts x n=2)
    # the step's line shows samples/s: the responses trained on over the step's wall time, which holds the
    # timed training step and lies within the call's own wall time
    samples = sync.config.data.train_batch_size * sync.config.actor_rollout_ref.rollout.n
    assert samples == 2 * rows and metrics["timing_s/step"] <= samples / metrics["perf/samples_per_s"] <= wall
    assert metrics["fully_async/count/stale_samples_processed"] == rows  # unit A, lag 1
    assert metrics["fully_async/count/stale_samples_dropped"] == rows  # unit B at version 0, lag 2
    assert len(trainer.pool.submitted) == 1 and trainer.pool.submitted[0] is unit_b  # B generated again
    assert trainer.last_sample_versions == [1, 2]

    batch = trainer.last_batch
    mask = batch["response_mask"].bool()
    weights = batch["rollout_is_weights"]
    formula = torch.clamp(torch.exp(batch["old_log_probs"] - batch["rollout_log_probs"]), max=2.0)
    torch.testing.assert_close(weights[mask], formula[mask], rtol=1e-5, atol=1e-6)
    a, b = mask[:rows], mask[rows:]
    assert torch.allclose(weights[:rows][a], torch.full_like(weights[:rows][a], 2.0))  # e^1.5 clamped
    assert torch.allclose(weights[rows:][b], torch.full_like(weights[rows:][b], math.exp(-1.0)), rtol=1e-3)
