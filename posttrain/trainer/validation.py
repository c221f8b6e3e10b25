"""Validation: generate for every validation prompt with `rollout.val_kwargs`, score, and report verl's
validation metrics under verl's names, plus the unbiased pass@k.

Per response the numbers are ``reward`` (the summed token-level score) and every field the scorer returned
beside it (``acc``, ``flexible_acc``, ``score``, ``pred``...; the manager's ``reward/*`` bookkeeping left
out, a field the scorer left empty left out of that response's numbers). verl 0.9.1's
`process_validation_metrics` turns them into ``mean@N``, ``std@N``, ``best@n/{mean,std}``,
``worst@n/{mean,std}`` and, where the scorer returns ``pred``, ``maj@n/{mean,std}`` per data source and
field, named as verl's trainer names them (``_val_metrics_update``):

    val-core/<data_source>/<core>/<mean@N | best@N/... | maj@N/...>   the core field at the largest N
    val-aux/<data_source>/<field>/<metric>                            everything else

where ``core`` is ``acc`` when the scorer returns it, else ``reward``, and N is the number of responses
per prompt (``val_kwargs.n`` when sampling; 1 when decoding greedily, where n copies would be one response
n times). ``val-aux/<data_source>/<core>/pass@k`` is `pass_at_k_unbiased` for k = 1, 2, 4, ..., N, a
response counting as correct when its core field is >= 1 (``acc`` true, or a reward of 1). Multi-turn
rollouts add verl's ``val-aux/num_turns/{min,max,mean}`` (verl counts the prompt as a turn: assistant and
user turns plus one).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable

import numpy as np

from posttrain.algorithms.validation_metrics import pass_at_k_metrics, process_validation_metrics
from posttrain.batch import Batch

__all__ = ["CORRECT_AT_LEAST", "core_variable", "run_validation", "validation_metrics"]

CORRECT_AT_LEAST = 1.0  # pass@k: a response is correct when its core field is at least this


def core_variable(fields: Any) -> str:
    """verl's headline field of a data source: ``acc`` when the scorer reports it, else ``reward``."""
    return "acc" if "acc" in fields else "reward"


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _scorer_fields(extra: dict, rows: int) -> dict[str, list[Any]]:
    """The scorer's per-row fields as lists; None where a row has no value (the manager writes nan there)."""
    out = {}
    for name, values in (extra or {}).items():
        if name.startswith("reward/"):  # the manager's own bookkeeping (errors), not the scorer's
            continue
        col = np.asarray(values).tolist() if isinstance(values, np.ndarray) else list(values)
        if len(col) == rows:
            out[name] = [None if _is_missing(v) else v for v in col]
    return out


def validation_metrics(data_sources: list[str], sample_uids: list[str], infos: dict[str, list[Any]],
                       num_turns: list[int] | None = None, seed: int = 42) -> dict[str, float]:
    """verl's named validation metrics (module docstring) and pass@k from each response's numbers.

    Args:
        data_sources, sample_uids: ``[N]`` per response; a prompt's responses share a uid.
        infos: ``{field: [N] values}`` with ``reward`` among them (verl's ``reward_extra_infos_dict``).
        num_turns: ``[N]`` verl's turn count per response (multi-turn), or None.
        seed: the bootstrap's seed (verl's 42).
    """
    nested = process_validation_metrics(data_sources, sample_uids, infos, seed=seed)
    metrics: dict[str, float] = {}
    for source, var2metric in nested.items():
        core = core_variable(var2metric)
        for var, metric2val in var2metric.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metric2val)
            for name, value in metric2val.items():
                headline = var == core and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
                metrics[f"{'val-core' if headline else 'val-aux'}/{source}/{var}/{name}"] = value
    by_source: dict[str, list[int]] = defaultdict(list)
    for i, source in enumerate(data_sources):
        by_source[source].append(i)
    for source, rows in by_source.items():
        core = core_variable(nested.get(source, ()))
        values = infos.get(core) or infos["reward"]
        kept = [i for i in rows if values[i] is not None]
        correct = [float(values[i]) >= CORRECT_AT_LEAST for i in kept]
        passes = pass_at_k_metrics([source] * len(kept), [sample_uids[i] for i in kept], correct)
        for name, value in passes.get(source, {}).items():
            metrics[f"val-aux/{source}/{core}/{name}"] = value
    if num_turns:
        turns = np.asarray(num_turns)
        metrics.update({"val-aux/num_turns/min": float(turns.min()), "val-aux/num_turns/max": float(turns.max()),
                        "val-aux/num_turns/mean": float(turns.mean())})
    return metrics


def run_validation(val_batches: list[Batch], generate: Callable[[Batch], Batch], score: Callable[[Batch], tuple],
                   n: int, reward_fn_key: str = "data_source") -> tuple[dict[str, float], list[dict]]:
    """(metrics, samples): `validation_metrics` over every batch's responses, and per batch ``{"batch":
    the generated rows, "scores": their summed scores}``. ``n``: the responses asked per prompt
    (``val_kwargs.n``); the metrics are named by the number each prompt got."""
    sources: list[str] = []
    uids: list[str] = []
    infos: dict[str, list[Any]] = {"reward": []}
    turns: list[int] = []
    samples: list[dict] = []
    for i, prompts in enumerate(val_batches):
        prompts.non_tensor_batch["uid"] = np.array([f"val-{i}-{j}" for j in range(len(prompts))], dtype=object)
        out = generate(prompts)
        scores, extra = score(out)
        seq_scores = scores.sum(-1).tolist()
        before = len(sources)
        sources += [str(s) for s in out.non_tensor_batch[reward_fn_key]]
        uids += [str(u) for u in out.non_tensor_batch["uid"]]
        infos["reward"] += [float(s) for s in seq_scores]
        for name, col in _scorer_fields(extra, len(seq_scores)).items():
            infos.setdefault(name, [None] * before).extend(col)  # a field new in this batch: None before it
        for col in infos.values():
            col.extend([None] * (len(sources) - len(col)))  # a field this batch's scorer left out
        if "multi_turn/turns" in out.non_tensor_batch:  # verl's __num_turns__: the prompt is a turn too
            turns += [int(t) + 1 for t in out.non_tensor_batch["multi_turn/turns"]]
        samples.append({"batch": out, "scores": seq_scores, "extra": extra})  # the scorer's acc etc. for the dumps
    return validation_metrics(sources, uids, infos, turns or None), samples
