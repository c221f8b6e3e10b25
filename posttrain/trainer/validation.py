"""Validation: generate for every validation prompt with `rollout.val_kwargs`, score, and report
the mean reward per data source as `val-core/<data_source>/reward/mean@<n>` (verl's name)."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import numpy as np

from posttrain.batch import Batch


def run_validation(val_batches: list[Batch], generate: Callable[[Batch], Batch], score: Callable[[Batch], tuple],
                   n: int, reward_fn_key: str = "data_source") -> tuple[dict[str, float], list[dict]]:
    """(metrics, samples): mean score per data source, and (prompt, response, score) rows for printing."""
    per_source: dict[str, list[float]] = defaultdict(list)
    samples: list[dict] = []
    for i, prompts in enumerate(val_batches):
        prompts.non_tensor_batch["uid"] = np.array([f"val-{i}-{j}" for j in range(len(prompts))], dtype=object)
        out = generate(prompts)
        scores, _ = score(out)
        seq_scores = scores.sum(-1).tolist()
        for source, s in zip(out.non_tensor_batch[reward_fn_key], seq_scores):
            per_source[str(source)].append(float(s))
        samples.append({"batch": out, "scores": seq_scores})
    metrics = {f"val-core/{src}/reward/mean@{n}": float(np.mean(vals)) for src, vals in per_source.items()}
    return metrics, samples
