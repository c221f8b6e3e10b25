"""Validation: generate for every validation prompt with `rollout.val_kwargs`, score, and report
the mean reward per data source as `val-core/<data_source>/reward/mean@<n>` (verl's name), and the
mean of each number the scorer returned beside its score (e.g. the built-in task's ``acc`` and
``flexible_acc``) as `val-aux/<data_source>/<name>/mean@<n>`, as verl names them."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import numpy as np

from posttrain.batch import Batch
from posttrain.rewards.manager import numeric_columns


def run_validation(val_batches: list[Batch], generate: Callable[[Batch], Batch], score: Callable[[Batch], tuple],
                   n: int, reward_fn_key: str = "data_source") -> tuple[dict[str, float], list[dict]]:
    """(metrics, samples): mean score per data source, and (prompt, response, score) rows for printing."""
    per_source: dict[str, list[float]] = defaultdict(list)
    aux: dict[tuple[str, str], list[float]] = defaultdict(list)
    samples: list[dict] = []
    for i, prompts in enumerate(val_batches):
        prompts.non_tensor_batch["uid"] = np.array([f"val-{i}-{j}" for j in range(len(prompts))], dtype=object)
        out = generate(prompts)
        scores, extra = score(out)
        seq_scores = scores.sum(-1).tolist()
        sources = [str(s) for s in out.non_tensor_batch[reward_fn_key]]
        for source, s in zip(sources, seq_scores):
            per_source[source].append(float(s))
        for name, values in numeric_columns(extra).items():
            if name.startswith("reward/"):  # the manager's own bookkeeping (errors), not the scorer's
                continue
            for source, v in zip(sources, values):
                aux[(source, name)].append(float(v))
        samples.append({"batch": out, "scores": seq_scores})
    metrics = {f"val-core/{src}/reward/mean@{n}": float(np.mean(vals)) for src, vals in per_source.items()}
    metrics.update({f"val-aux/{src}/{name}/mean@{n}": float(np.mean(vals)) for (src, name), vals in aux.items()})
    return metrics, samples

