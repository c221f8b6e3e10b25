"""Validation metrics: verl 0.9.1's bootstrap best/worst/majority@N, and the unbiased pass@k estimator.

verl's names and signatures (``verl.trainer.ppo.metric_utils``), so code written against verl runs here:

    bootstrap_metric(data, subset_size, reduce_fns, n_bootstrap=1000, seed=42) -> [(mean, std), ...]
    calc_maj_val(data, vote_key, val_key) -> the first ``val_key`` of the most common ``vote_key``
    process_validation_metrics(data_sources, sample_uids, infos_dict, seed=42, expected_acc_counts=None)
        -> {data_source: {var_name: {metric_name: value}}}

Their values equal verl 0.9.1's on the same inputs (tests/algorithms/test_validation_metrics.py holds verl's
outputs). What they mean, for one prompt with N responses, each with a value ``v`` (its reward, its ``acc``,
...) and optionally a prediction ``pred`` (the answer it gave):

- ``mean@N`` / ``std@N``: the mean and (population) standard deviation of the N values.
- ``best@n/mean``, ``worst@n/mean``: draw n of the N values with replacement, 1000 times (numpy's
  legacy generator seeded with ``seed``); the mean over the draws of the best (worst) value in a draw.
  ``/std`` is the standard deviation over the draws. n runs 2, 4, 8, ... below N, then N.
- ``maj@n/mean``: in each draw the most common ``pred`` wins (a tie goes to the one drawn first) and the
  draw scores the value of the first response that gave it; only where every response has a ``pred``.

Each is computed per prompt (``sample_uids``) and averaged over the prompts of a data source. ``best@N``
is verl's stand-in for pass@N, and it is biased: draws with replacement repeat responses, so it is lower
than the chance that one of N fresh responses is right. `pass_at_k_unbiased` is the unbiased estimator of
Chen et al. 2021 (https://arxiv.org/abs/2107.03374, eq. 1): the chance that at least one of k responses
drawn without replacement from the N is correct, ``1 - C(N-c, k) / C(N, k)`` for c correct ones.

verl seeds numpy's global generator in every call; these functions draw the same numbers from a
generator of their own (``np.random.RandomState(seed)``) and leave the global one alone.
`process_validation_metrics` computes the best/worst/majority draws as array operations on the same
indices (verl loops over them in Python, about 100x slower); the result is the same, bit for bit.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from typing import Any, Callable

import numpy as np

__all__ = ["bootstrap_metric", "calc_maj_val", "pass_at_k_metrics", "pass_at_k_unbiased", "process_validation_metrics",
           "subset_sizes"]

N_BOOTSTRAP = 1000  # verl's draws per metric


@functools.lru_cache(maxsize=64)
def _bootstrap_indices(n_data: int, subset_size: int, n_bootstrap: int, seed: int) -> np.ndarray:
    """``[n_bootstrap, subset_size]`` indices drawn with replacement: verl's ``np.random.seed(seed)`` then
    ``np.random.choice(n_data, ...)``, from a generator of its own (the same stream). Read-only: shared."""
    idx = np.random.RandomState(seed).choice(n_data, size=(n_bootstrap, subset_size), replace=True)
    idx.setflags(write=False)
    return idx


def bootstrap_metric(data: list[Any], subset_size: int, reduce_fns: list[Callable[[np.ndarray], float]],
                     n_bootstrap: int = 1000, seed: int = 42) -> list[tuple[float, float]]:
    """(mean, std) over ``n_bootstrap`` draws of ``subset_size`` items of ``data`` (with replacement) of
    each ``reduce_fn(draw)``, one pair per function; verl's function, same draws and values."""
    data_np = np.array(data, dtype=object)
    idx = _bootstrap_indices(len(data_np), subset_size, n_bootstrap, seed)
    results = np.empty((len(reduce_fns), n_bootstrap), dtype=np.float64)
    for f, reduce_fn in enumerate(reduce_fns):
        for b in range(n_bootstrap):
            results[f, b] = reduce_fn(data_np[idx[b]])
    return [(float(np.mean(results[f])), float(np.std(results[f]))) for f in range(len(reduce_fns))]


def calc_maj_val(data: list[dict[str, Any]], vote_key: str, val_key: str) -> float:
    """The ``val_key`` of the first item whose ``vote_key`` is the most common one (a tie goes to the
    vote seen first); verl's function."""
    vote2vals: dict[Any, list] = {}
    for d in data:
        vote2vals.setdefault(d[vote_key], []).append(d[val_key])
    maj_vote = max(vote2vals, key=lambda v: len(vote2vals[v]))  # max keeps the first of equal counts
    return vote2vals[maj_vote][0]


def subset_sizes(n_resps: int) -> list[int]:
    """The n of best@n / worst@n / maj@n for N responses: 2, 4, 8, ... below N, then N (none for N <= 1)."""
    if n_resps <= 1:
        return []
    ns, n = [], 2
    while n < n_resps:
        ns.append(n)
        n *= 2
    return ns + [n_resps]


def _best_worst(values: list[Any], n: int, seed: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """``bootstrap_metric(values, n, [np.max, np.min])`` as array operations (same indices, same values)."""
    v = np.asarray(values, dtype=np.float64)
    if not np.isfinite(v).all():  # nan orders differently in object and float max: take verl's path
        return tuple(bootstrap_metric(values, n, [np.max, np.min], N_BOOTSTRAP, seed))
    draws = v[_bootstrap_indices(len(v), n, N_BOOTSTRAP, seed)]  # [B, n]
    best, worst = draws.max(axis=1), draws.min(axis=1)
    return (float(np.mean(best)), float(np.std(best))), (float(np.mean(worst)), float(np.std(worst)))


def _majority(values: list[Any], preds: list[Any], n: int, seed: int) -> tuple[float, float]:
    """``bootstrap_metric`` of ``calc_maj_val`` over ``{"val", "pred"}`` rows, as array operations."""
    v = np.asarray(values, dtype=np.float64)
    if not np.isfinite(v).all():
        rows = [{"val": a, "pred": p} for a, p in zip(values, preds, strict=True)]
        maj = functools.partial(calc_maj_val, vote_key="pred", val_key="val")
        return bootstrap_metric(rows, n, [maj], N_BOOTSTRAP, seed)[0]
    codes_of: dict[Any, int] = {}  # equal preds (by == and hash, as a dict's keys) share a code
    codes = np.array([codes_of.setdefault(p, len(codes_of)) for p in preds])
    idx = _bootstrap_indices(len(v), n, N_BOOTSTRAP, seed)  # [B, n]
    drawn = codes[idx]  # [B, n]
    counts = np.zeros((N_BOOTSTRAP, len(codes_of)), dtype=np.int64)  # [B, K]
    first = np.full((N_BOOTSTRAP, len(codes_of)), n, dtype=np.int64)  # [B, K] first position of each vote
    for k in range(len(codes_of)):
        hit = drawn == k
        counts[:, k] = hit.sum(axis=1)
        first[:, k] = np.where(counts[:, k] > 0, hit.argmax(axis=1), n)
    # the winner: the most votes, and among those the vote drawn first (a dict's order in calc_maj_val)
    tied = counts == counts.max(axis=1, keepdims=True)
    winner = np.where(tied, first, n + 1).argmin(axis=1)  # [B]
    rows = np.arange(N_BOOTSTRAP)
    maj = v[idx[rows, first[rows, winner]]]
    return float(np.mean(maj)), float(np.std(maj))


def _group(data_sources: Any, sample_uids: Any, infos_dict: dict[str, list[Any]]) -> dict:
    """{data_source: {uid: {var: [values in sample order]}}}."""
    grouped: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for i, data_source in enumerate(data_sources):
        var2vals = grouped[data_source][sample_uids[i]]
        for var_name, var_vals in infos_dict.items():
            var2vals[var_name].append(var_vals[i])
    return grouped


def _count_missing_as_wrong(grouped: dict, expected_acc_counts: dict[tuple[str, str], int]) -> None:
    """verl's ``expected_acc_counts``: a source that reports ``acc`` counts each of a prompt's missing
    responses as ``acc=0`` (``acc_success_only`` keeps the responses that exist)."""
    acc_sources = {src for src, uids in grouped.items()
                   if any(x is not None for var2vals in uids.values() for x in var2vals.get("acc", []))}
    for (data_source, uid), expected in expected_acc_counts.items():
        if data_source not in acc_sources:
            continue
        var2vals = grouped[data_source][uid]
        observed = [x for x in var2vals.get("acc", []) if x is not None]
        var2vals["acc_success_only"] = observed
        var2vals["acc"] = observed + [0.0] * max(expected - len(observed), 0)


def _prompt_metrics(var2vals: dict[str, list[Any]], seed: int) -> dict[str, dict[str, float]]:
    """{var: {metric: value}} of one prompt's responses (the module docstring's metrics)."""
    pred_vals = var2vals.get("pred")
    out = {}
    for var_name, var_vals in var2vals.items():
        var_vals = [x for x in var_vals if x is not None]
        if not var_vals or isinstance(var_vals[0], str):  # text (the preds themselves) has no mean
            continue
        has_pred = pred_vals is not None and len(pred_vals) == len(var_vals) and all(p is not None for p in pred_vals)
        n_resps = len(var_vals)
        metric = {f"mean@{n_resps}": float(np.mean(var_vals))}
        if n_resps > 1:
            metric[f"std@{n_resps}"] = float(np.std(var_vals))
            for n in subset_sizes(n_resps):
                (metric[f"best@{n}/mean"], metric[f"best@{n}/std"]), (metric[f"worst@{n}/mean"],
                                                                      metric[f"worst@{n}/std"]) = _best_worst(var_vals, n, seed)
                if has_pred:
                    metric[f"maj@{n}/mean"], metric[f"maj@{n}/std"] = _majority(var_vals, pred_vals, n, seed)
        out[var_name] = metric
    return out


def process_validation_metrics(data_sources: list[str], sample_uids: list[str], infos_dict: dict[str, list[Any]],
                               seed: int = 42, expected_acc_counts: dict[tuple[str, str], int] | None = None
                               ) -> dict[str, dict[str, dict[str, float]]]:
    """{data_source: {var_name: {metric_name: value}}}: each metric of the module docstring per prompt
    (responses grouped by ``sample_uids``), averaged over the prompts of each data source; verl's function.

    Args:
        data_sources: ``[N]`` each response's data source.
        sample_uids: ``[N]`` each response's prompt id (a prompt's responses share it).
        infos_dict: ``{var_name: [N] values}``: numbers get metrics (None entries are left out), text
            does not; ``pred`` (the answers, any hashable) is the vote of maj@n.
        seed: the bootstrap's seed.
        expected_acc_counts: ``{(data_source, uid): responses expected}``: missing ones count as acc 0.
    """
    grouped = _group(data_sources, sample_uids, infos_dict)
    if expected_acc_counts:
        _count_missing_as_wrong(grouped, expected_acc_counts)
    per_prompt: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # src -> var -> metric -> [uid]
    for data_source, uid2var2vals in grouped.items():
        for var2vals in uid2var2vals.values():
            for var_name, metric in _prompt_metrics(var2vals, seed).items():
                for metric_name, value in metric.items():
                    per_prompt[data_source][var_name][metric_name].append(value)
    return {src: {var: {name: float(np.mean(vals)) for name, vals in metrics.items()} for var, metrics in var2m.items()}
            for src, var2m in per_prompt.items()}


def pass_at_k_unbiased(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator (Chen et al. 2021, https://arxiv.org/abs/2107.03374, eq. 1): for n
    responses of which c are correct, the chance that k drawn without replacement hold a correct one,
    ``1 - C(n-c, k) / C(n, k)``, in the paper's numerically stable product form
    ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` (binomials of n=200 overflow floats; the product does not)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n correct responses, got c={c}, n={n}")
    if n - c < k:  # every k-subset holds a correct response
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_metrics(data_sources: list[str], sample_uids: list[str], correct: list[bool],
                      ks: list[int] | None = None) -> dict[str, dict[str, float]]:
    """{data_source: {"pass@k": value}}: `pass_at_k_unbiased` per prompt (its responses grouped by
    ``sample_uids``), averaged over the prompts of each data source. ``ks``: 1 and `subset_sizes` of the
    fewest responses any prompt of the source has (k <= n for every prompt); ks above that are left out."""
    counts: dict = defaultdict(dict)  # src -> uid -> [n, c]
    for src, uid, ok in zip(data_sources, sample_uids, correct, strict=True):
        n_c = counts[src].setdefault(uid, [0, 0])
        n_c[0] += 1
        n_c[1] += bool(ok)
    out = {}
    for src, per_uid in counts.items():
        fewest = min(n for n, _ in per_uid.values())
        wanted = sorted(set([1] + subset_sizes(fewest))) if ks is None else ks
        out[src] = {f"pass@{k}": float(np.mean([pass_at_k_unbiased(n, c, k) for n, c in per_uid.values()]))
                    for k in wanted if k <= fewest}
    return out
