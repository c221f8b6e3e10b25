"""Validation metrics against verl 0.9.1's own outputs (recorded in verl_reference/, with the script that ran
verl's functions), verl's own tests of them (ported), hand-computed cases, and the unbiased pass@k estimator
against exact binomials and a Monte-Carlo draw."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from posttrain.algorithms.validation_metrics import (bootstrap_metric, calc_maj_val, pass_at_k_metrics,
                                                     pass_at_k_unbiased, process_validation_metrics, subset_sizes)

REFERENCE = json.loads((Path(__file__).parent / "verl_reference" / "validation_metrics_verl091.json").read_text())
FNS = {"mean": np.mean, "max": np.max, "min": np.min, "median": np.median}


def _pvm(case):
    counts = case["expected_acc_counts"]
    return process_validation_metrics(case["data_sources"], case["sample_uids"], case["infos_dict"], seed=case["seed"],
                                      expected_acc_counts=None if counts is None else {tuple(k): n for k, n in counts})


# ---------------------------------------------------------------- equal to verl 0.9.1, bit for bit

@pytest.mark.parametrize("case", REFERENCE["bootstrap_metric"], ids=lambda c: f"n{len(c['data'])}-k{c['subset_size']}")
def test_bootstrap_metric_equals_verl(case):
    got = bootstrap_metric(case["data"], case["subset_size"], [FNS[f] for f in case["reduce_fns"]],
                           n_bootstrap=case["n_bootstrap"], seed=case["seed"])
    assert [list(pair) for pair in got] == case["result"]  # exact: the same draws, the same sums


@pytest.mark.parametrize("case", REFERENCE["calc_maj_val"], ids=lambda c: str(len(c["data"])))
def test_calc_maj_val_equals_verl(case):
    assert calc_maj_val(case["data"], "pred", "val") == case["result"]


@pytest.mark.parametrize("case", REFERENCE["process_validation_metrics"], ids=lambda c: c["name"])
def test_process_validation_metrics_equals_verl(case):
    assert _pvm(case) == case["result"]  # every source, variable and metric name, every value exact


def test_the_reference_covers_what_it_should():
    """The recorded cases reach majority votes, several subset sizes, None values and expected counts."""
    names = {m for c in REFERENCE["process_validation_metrics"] for v in c["result"].values() for x in v.values()
             for m in x}
    assert {"maj@2/mean", "maj@16/mean", "best@8/mean", "worst@13/std", "mean@1"} <= names
    assert "acc_success_only" in REFERENCE["process_validation_metrics"][3]["result"]["a"]


def test_a_changed_seed_or_input_differs_from_verl():
    """Negative controls: the comparison above can fail. Another bootstrap seed, or one value changed,
    gives numbers that are not verl's."""
    case = REFERENCE["process_validation_metrics"][2]
    assert _pvm({**case, "seed": case["seed"] + 1}) != case["result"]
    infos = {k: list(v) for k, v in case["infos_dict"].items()}
    infos["acc"][0] = 1.0 - infos["acc"][0]
    assert _pvm({**case, "infos_dict": infos}) != case["result"]
    first = REFERENCE["bootstrap_metric"][2]
    assert bootstrap_metric(first["data"], first["subset_size"], [np.max], first["n_bootstrap"], first["seed"] + 1)[0] \
        != tuple(first["result"][1])


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # nan in the draws
def test_the_fast_bootstrap_equals_verl_s_loop_with_nan_too():
    """The array form of best/worst/majority equals bootstrap_metric's loop (verl's own), exactly; a nan value
    takes the loop itself."""
    rng = np.random.default_rng(11)
    for n in (2, 5, 16):
        vals = [float(x) for x in rng.integers(0, 3, size=n)]
        preds = [str(x) for x in rng.integers(0, 3, size=n)]
        got = process_validation_metrics(["s"] * n, ["u"] * n, {"v": vals, "pred": preds}, seed=3)["s"]["v"]
        for k in subset_sizes(n):
            (b, bs), (w, ws) = bootstrap_metric(vals, k, [np.max, np.min], 1000, 3)
            maj = bootstrap_metric([{"val": v, "pred": p} for v, p in zip(vals, preds)], k,
                                   [lambda d: calc_maj_val(d, "pred", "val")], 1000, 3)[0]
            assert (got[f"best@{k}/mean"], got[f"best@{k}/std"], got[f"worst@{k}/mean"], got[f"worst@{k}/std"]) == (b, bs, w, ws)
            assert (got[f"maj@{k}/mean"], got[f"maj@{k}/std"]) == maj
    vals = [1.0, float("nan"), 0.0]
    with_nan = process_validation_metrics(["s"] * 3, ["u"] * 3, {"v": vals})["s"]["v"]
    loop = bootstrap_metric(vals, 3, [np.max, np.min], 1000, 42)
    got = [with_nan["best@3/mean"], with_nan["best@3/std"], with_nan["worst@3/mean"], with_nan["worst@3/std"]]
    assert np.array_equal(got, [x for pair in loop for x in pair], equal_nan=True)


def test_numpy_s_global_generator_is_left_alone():
    np.random.seed(5)
    want = np.random.random()
    np.random.seed(5)
    process_validation_metrics(["s"] * 4, ["u"] * 4, {"acc": [1.0, 0.0, 1.0, 1.0], "pred": list("abab")})
    bootstrap_metric([1, 2, 3], 2, [np.mean])
    assert np.random.random() == want  # verl's functions reseed it; these draw from their own generator


# ---------------------------------------------------------------- verl's own tests (tests/trainer/ppo/test_metric_utils_on_cpu.py)

def test_verl_bootstrap_metric_basic():
    (mean_mean, _), (max_mean, _) = bootstrap_metric([1, 2, 3, 4, 5], subset_size=3, reduce_fns=[np.mean, np.max],
                                                     n_bootstrap=100, seed=42)
    assert mean_mean == pytest.approx(3.0, abs=0.3) and 3.5 < max_mean < 5.0
    with pytest.raises(ValueError):
        bootstrap_metric([], subset_size=1, reduce_fns=[np.mean])


def test_verl_calc_maj_val_basic_and_tie():
    assert calc_maj_val([{"pred": "A", "val": 0.9}, {"pred": "B", "val": 0.8}, {"pred": "A", "val": 0.7}], "pred", "val") == 0.9
    tie = [{"pred": "A", "val": 0.9}, {"pred": "B", "val": 0.8}, {"pred": "B", "val": 0.7}, {"pred": "A", "val": 0.6}]
    assert calc_maj_val(tie, vote_key="pred", val_key="val") == 0.9  # verl accepts 0.9 or 0.8: the first vote wins


def test_verl_process_validation_metrics_cases():
    res = process_validation_metrics(["source1", "source1", "source2"], ["prompt1", "prompt1", "prompt2"],
                                     {"score": [0.8, 0.9, 0.7]}, seed=42)
    assert res["source1"]["score"]["mean@2"] == pytest.approx(0.85) and "source2" in res
    res = process_validation_metrics(["source1"] * 3, ["prompt1"] * 3, {"score": [0.8, 0.9, 0.7], "pred": ["A", "B", "A"]})
    assert "maj@2/mean" in res["source1"]["score"]
    res = process_validation_metrics(["source1"] * 2, ["prompt1"] * 2, {"reward": [0.4, 0.6], "acc": [1.0, 1.0]},
                                     expected_acc_counts={("source1", "prompt1"): 4, ("source1", "prompt2"): 4})
    assert res["source1"]["acc"]["mean@4"] == pytest.approx(0.25)
    assert res["source1"]["acc_success_only"]["mean@2"] == pytest.approx(1.0)
    assert res["source1"]["reward"]["mean@2"] == pytest.approx(0.5)
    res = process_validation_metrics(["acc_source", "reward_source"], ["acc_prompt", "reward_prompt"],
                                     {"reward": [1.0, 0.5], "acc": [1.0, None]},
                                     expected_acc_counts={("acc_source", "acc_prompt"): 2, ("reward_source", "reward_prompt"): 2})
    assert res["acc_source"]["acc"]["mean@2"] == pytest.approx(0.5)
    assert "acc" not in res["reward_source"] and "acc_success_only" not in res["reward_source"]


# ---------------------------------------------------------------- by hand

def test_a_hand_computed_prompt():
    """One prompt, responses (acc, pred) = (1, "7"), (0, "5"), (0, "5"). mean@3 = 1/3; std@3 =
    sqrt(((2/3)^2 + 2 (1/3)^2) / 3) = sqrt(2)/3. best@3 is the chance a draw of 3 with replacement holds the
    right one, 1 - (2/3)^3 = 19/27 = 0.7037 in expectation (the bootstrap's 1000 draws land within 0.05);
    worst@3 is 1/27. maj@3: the right answer wins only when drawn at least twice, 3 (1/3)^2 (2/3) + (1/3)^3 = 7/27.
    Two prompts' metrics average: a second prompt with mean 1 makes mean@3 (1/3 + 1) / 2 = 2/3."""
    res = process_validation_metrics(["s"] * 3, ["u"] * 3, {"acc": [1.0, 0.0, 0.0], "pred": ["7", "5", "5"]})["s"]["acc"]
    assert set(res) == {"mean@3", "std@3", "best@2/mean", "best@2/std", "worst@2/mean", "worst@2/std",
                        "maj@2/mean", "maj@2/std", "best@3/mean", "best@3/std", "worst@3/mean", "worst@3/std",
                        "maj@3/mean", "maj@3/std"}  # subset sizes 2 and N=3
    assert res["mean@3"] == pytest.approx(1 / 3) and res["std@3"] == pytest.approx(math.sqrt(2) / 3)
    assert res["best@3/mean"] == pytest.approx(19 / 27, abs=0.05) and res["worst@3/mean"] == pytest.approx(1 / 27, abs=0.02)
    assert res["maj@3/mean"] == pytest.approx(7 / 27, abs=0.05)
    # maj@2: a draw of "7" then "5" is a tie, which the first drawn wins: P(first is "7") = 1/3
    assert res["maj@2/mean"] == pytest.approx(1 / 3, abs=0.05)
    two = process_validation_metrics(["s"] * 6, list("uuuvvv"), {"acc": [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]})["s"]["acc"]
    assert two["mean@3"] == pytest.approx(2 / 3)
    assert subset_sizes(1) == [] and subset_sizes(2) == [2] and subset_sizes(8) == [2, 4, 8] and subset_sizes(10) == [2, 4, 8, 10]


# ---------------------------------------------------------------- unbiased pass@k

def _exact_pass_at_k(n, c, k):
    """1 - C(n-c, k) / C(n, k) in exact rationals."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_by_hand_and_by_enumeration():
    # n=5 responses, c=2 correct, k=2: C(3,2)/C(5,2) = 3/10 of the pairs hold no correct one -> 7/10
    assert pass_at_k_unbiased(5, 2, 2) == pytest.approx(0.7, abs=1e-15)
    # the same by listing all 10 pairs of responses [1, 1, 0, 0, 0]
    pairs = list(itertools.combinations([1, 1, 0, 0, 0], 2))
    assert sum(any(p) for p in pairs) / len(pairs) == 0.7
    assert pass_at_k_unbiased(5, 2, 1) == pytest.approx(0.4)  # pass@1 = c / n
    assert pass_at_k_unbiased(5, 0, 3) == 0.0 and pass_at_k_unbiased(5, 3, 3) == 1.0  # n - c < k: always
    for n, c, k in [(10, 3, 4), (16, 1, 8), (200, 13, 100), (200, 199, 1), (64, 0, 64)]:
        assert pass_at_k_unbiased(n, c, k) == pytest.approx(float(_exact_pass_at_k(n, c, k)), rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k_unbiased(4, 1, 5)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k_unbiased(4, 5, 2)


def test_pass_at_k_matches_monte_carlo_and_differs_from_best_at_n():
    """Drawing k of n responses without replacement 200,000 times: the share of draws with a correct one is
    the estimator (1 - C(13,4)/C(16,4) = 0.6071) within 4 standard errors. verl's best@k (draws with
    replacement) is lower: the negative control that the two are different conventions."""
    rng = np.random.default_rng(0)
    n, c, k, trials = 16, 3, 4, 200_000
    responses = np.array([1] * c + [0] * (n - c))
    draws = np.argsort(rng.random((trials, n)), axis=1)[:, :k]  # k distinct responses per trial
    hit_rate = responses[draws].max(axis=1).mean()
    want = pass_at_k_unbiased(n, c, k)
    assert abs(hit_rate - want) < 4 * math.sqrt(want * (1 - want) / trials)
    # one right response in 4: pass@4 is 1 (all 4 drawn), best@4 is 1 - (3/4)^4 = 0.68 (4 draws with replacement)
    best = process_validation_metrics(["s"] * 4, ["u"] * 4, {"acc": [1.0, 0.0, 0.0, 0.0]})["s"]["acc"]["best@4/mean"]
    assert pass_at_k_unbiased(4, 1, 4) == 1.0 and best == pytest.approx(1 - 0.75**4, abs=0.05)


def test_pass_at_k_metrics_per_source():
    # source a: prompt u has 2 of 4 right (pass@1 0.5, pass@2 1 - C(2,2)/C(4,2) = 5/6, pass@4 1),
    #           prompt v has 0 of 4 (all 0) -> means 0.25, 5/12, 0.5; source b: one prompt, 2 responses, 1 right
    sources = ["a"] * 8 + ["b"] * 2
    uids = ["u"] * 4 + ["v"] * 4 + ["w"] * 2
    correct = [1, 0, 1, 0, 0, 0, 0, 0, 1, 0]
    res = pass_at_k_metrics(sources, uids, correct)
    assert res["a"] == {"pass@1": 0.25, "pass@2": pytest.approx(5 / 12), "pass@4": 0.5}
    assert res["b"] == {"pass@1": 0.5, "pass@2": 1.0}
    assert pass_at_k_metrics(sources, uids, correct, ks=[3])["b"] == {}  # k above a prompt's n is left out
