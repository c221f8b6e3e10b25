"""Dispatch helpers (no processes): split/gather round trips with padding, length balancing, and the
per-metric combination rules checked against a one-process computation with the real loss functions."""

import itertools

import numpy as np
import pytest
import torch

from posttrain.algorithms import LOSS_AGG_MODES, agg_loss, compute_value_loss, get_policy_loss_fn, kl_penalty
from posttrain.batch import Batch
from posttrain.distributed.split import (
    balance_batch,
    balanced_partition,
    combine_metrics,
    gather_from_ranks,
    inverse_permutation,
    metric_rule,
    rank_row_counts,
    split_for_ranks,
)
from posttrain.workers.common import ConfigWithBatchInfo, MetricMeter

P, R = 3, 5  # prompt and response lengths


def make_batch(n: int, seed: int = 0, response_mask: bool = True) -> Batch:
    g = torch.Generator().manual_seed(seed)
    resp_len = torch.randint(0, R + 1, (n,), generator=g)
    resp_mask = (torch.arange(R)[None, :] < resp_len[:, None]).long()
    attn = torch.cat([torch.ones(n, P, dtype=torch.long), resp_mask], dim=1)
    tensors = {"input_ids": torch.randint(0, 50, (n, P + R), generator=g), "attention_mask": attn,
               "responses": torch.randint(0, 50, (n, R), generator=g)}
    if response_mask:
        tensors["response_mask"] = resp_mask.float()
    return Batch.from_dict(tensors, {"uid": [f"u{i // 2}" for i in range(n)]}, meta_info={"temperature": 1.0})


def assert_batches_equal(a: Batch, b: Batch) -> None:
    assert len(a) == len(b) and sorted(a.keys()) == sorted(b.keys())
    for k in a.batch.keys():
        assert torch.equal(a[k], b[k]), k
    for k in a.non_tensor_batch:
        assert list(a[k]) == list(b[k]), k


# ------------------------------------------------------------------------------------------ split / gather
@pytest.mark.parametrize("n, w", [(7, 3), (8, 4), (5, 4), (1, 2)])
def test_split_then_gather_restores_the_batch(n, w):
    batch = make_batch(n)
    chunks, pad = split_for_ranks(batch, w)
    assert pad == -n % w and len(chunks) == w and {len(c) for c in chunks} == {(n + pad) // w}
    assert_batches_equal(gather_from_ranks(chunks, pad), batch)


def test_gather_of_per_rank_tensors_and_tuples_equals_the_one_process_result():
    batch = make_batch(7)
    chunks, pad = split_for_ranks(batch, 3)

    def compute(b):  # a worker method returning (tensor [n, R], None), like compute_log_prob without entropy
        return b["responses"].float() * b["response_mask"], None

    got, none = gather_from_ranks([compute(c) for c in chunks], pad)
    want, _ = compute(batch)
    assert none is None and torch.equal(got, want)


def test_split_of_a_tensor_pads_like_a_batch():
    t = torch.arange(10).reshape(5, 2)
    chunks, pad = split_for_ranks(t, 2)
    assert pad == 1 and torch.equal(chunks[1][-1], t[0])
    assert torch.equal(gather_from_ranks(chunks, pad), t)


@pytest.mark.parametrize("has_mask", [True, False])
def test_inert_padding_zeroes_the_response_mask_of_padding_rows_only(has_mask):
    batch = make_batch(5, response_mask=has_mask)
    before = {k: v.clone() for k, v in batch.batch.items()}
    chunks, pad = split_for_ranks(batch, 4, inert_padding=True)
    padded = Batch.concat(chunks)
    real_mask = batch["response_mask"] if has_mask else batch["attention_mask"][:, P:].to(padded["response_mask"].dtype)
    assert pad == 3
    assert torch.equal(padded["response_mask"][:5], real_mask)
    assert padded["response_mask"][5:].sum() == 0
    assert set(batch.batch.keys()) == set(before) and all(torch.equal(batch[k], v) for k, v in before.items())


def test_gather_refuses_mixed_kinds():
    with pytest.raises(ValueError, match="different kinds"):
        gather_from_ranks([torch.zeros(2), make_batch(2)], 0)
    with pytest.raises(ValueError, match="None"):
        gather_from_ranks([None, torch.zeros(2)], 0)


# ------------------------------------------------------------------------------------------ balance
def test_balanced_partition_finds_the_even_split_of_a_hand_case():
    groups = balanced_partition([10, 9, 8, 7, 6, 5, 4, 3], [4, 4])
    assert sorted(len(g) for g in groups) == [4, 4]
    assert [sum([10, 9, 8, 7, 6, 5, 4, 3][i] for i in g) for g in groups] == [26, 26]


def test_balanced_partition_is_near_the_brute_force_optimum():
    rng = np.random.default_rng(0)
    for _ in range(20):
        w = rng.integers(1, 100, size=8)
        groups = balanced_partition(w, [4, 4])
        gap = abs(w[groups[0]].sum() - w[groups[1]].sum())
        best = min(abs(2 * w[list(c)].sum() - w.sum()) for c in itertools.combinations(range(8), 4))
        assert gap <= best + 2 * np.sort(w)[1], (w, gap, best)  # within two of the smallest items


def test_balance_batch_evens_token_sums_and_the_permutation_undoes_it():
    n, w = 32, 4
    batch = make_batch(n, seed=3)
    order = torch.argsort(batch["attention_mask"].sum(-1))  # worst case: chunks sorted by length
    batch.reorder(order.numpy())
    original = batch.index_select(np.arange(n))
    lengths = batch["attention_mask"].sum(-1)
    naive = [int(lengths[i * 8:(i + 1) * 8].sum()) for i in range(w)]

    perm = balance_batch(batch, w)
    sums = [int(c["attention_mask"].sum()) for c in split_for_ranks(batch, w)[0]]
    assert max(sums) - min(sums) <= 1 < max(naive) - min(naive), (sums, naive)
    assert sorted(perm.tolist()) == list(range(n))
    assert_batches_equal(batch.index_select(inverse_permutation(perm)), original)
    # a result computed on the balanced order goes back to the original rows
    result = batch["attention_mask"].sum(-1)
    assert torch.equal(result[inverse_permutation(perm)], lengths)


def test_balance_batch_with_padding_gives_each_rank_its_row_count():
    batch = make_batch(10, seed=1)
    perm = balance_batch(batch, 4)
    assert rank_row_counts(10, 4) == [3, 3, 3, 1] and sorted(perm.tolist()) == list(range(10))


# ------------------------------------------------------------------------------------------ metrics
def test_metric_rules_by_name():
    assert metric_rule("actor/pg_loss") == "mean" and metric_rule("critic/vf_loss") == "mean"
    assert metric_rule("actor/pg_clipfrac") == "sum" and metric_rule("critic/vf_clipfrac") == "sum"
    assert metric_rule("actor/grad_norm") == "rank0" and metric_rule("critic/nonfinite_skipped") == "rank0"
    assert metric_rule("timing_s/gen") == "mean" and metric_rule("perf/max_memory_allocated_gb") == "max"


_CFG = {"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": 3.0}


def _tensors(n: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 0, 4, 1, 5, 2, 4])[:n]  # one empty response
    mask = (torch.arange(R)[None, :] < lengths[:, None]).float()
    r = lambda: torch.randn(n, R, generator=g, dtype=torch.float64)  # noqa: E731
    old = r() * 0.3 - 2
    return {"mask": mask, "old": old, "logp": old + r() * 0.2, "ref": old + r() * 0.1, "adv": r(),
            "entropy": r().abs(), "vpreds": r(), "values": r(), "returns": r()}


def _micro_metrics(t: dict, rows: torch.Tensor, mode: str, info: dict, meter: MetricMeter) -> None:
    """What ActorWorker/CriticWorker._micro_step record for one micro-batch (workers/actor.py, critic.py)."""
    mb = {k: v[rows] for k, v in t.items()}
    mask = mb["mask"]
    pg_loss, pg_metrics = get_policy_loss_fn("vanilla")(
        mb["old"], mb["logp"], mb["adv"], mask, loss_agg_mode=mode, config=ConfigWithBatchInfo(_CFG, info))
    share = float(mask.sum()) / max(info.get("batch_num_tokens", float(mask.sum())), 1.0)
    meter.add("actor/pg_loss", pg_loss)
    meter.add("actor/entropy", agg_loss(mb["entropy"], mask, mode, **info))
    meter.add("actor/kl_loss", agg_loss(kl_penalty(mb["logp"], mb["ref"], "low_var_kl"), mask, mode, **info))
    for name, value in pg_metrics.items():
        meter.add(name, value, share)
    vf_loss, vf_clipfrac = compute_value_loss(mb["vpreds"], mb["returns"], mb["values"], mask, 0.5, mode, **info)
    meter.add("critic/vf_loss", vf_loss)
    meter.add("critic/vf_clipfrac", vf_clipfrac, share)
    meter.add("critic/vpred_mean", (mb["vpreds"] * mask).sum() / mask.sum().clamp(min=1), share)


def _global_info(mask: torch.Tensor, world_size: int) -> dict:
    """``global_batch_info`` as the all-reduce in workers/common.py produces it on every rank."""
    return {"dp_size": world_size, "batch_num_tokens": float(mask.sum()),
            "global_batch_size": float((mask.sum(-1) > 0).sum())}


def _finish(meter: MetricMeter) -> None:
    meter.end_mini_batch(**{"actor/grad_norm": 1.25, "critic/grad_norm": 0.5})
    meter.count("actor/nonfinite_skipped", 0.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_combined_rank_metrics_equal_the_one_process_metrics(mode):
    """2 ranks x 2 mini-batches x micro-batches of 1 row vs one process on the same mini-batches.
    Rank r's mini-batch k is rows {4r + 2k, 4r + 2k + 1}; the one-process mini-batch k is their union."""
    t = _tensors()
    world = 2
    minis = [[torch.tensor([4 * r + 2 * k, 4 * r + 2 * k + 1]) for k in range(2)] for r in range(world)]
    per_rank = []
    for r in range(world):
        meter = MetricMeter()
        for k in range(2):
            info = _global_info(t["mask"][torch.cat([minis[q][k] for q in range(world)])], world)
            for row in minis[r][k]:
                _micro_metrics(t, row.reshape(1), mode, info, meter)
            _finish(meter)
        per_rank.append({**meter.result(), "actor/lr": 1e-6})

    ref_meter = MetricMeter()
    for k in range(2):  # one process: the whole mini-batch in one micro-batch, local normalisers
        _micro_metrics(t, torch.cat([minis[q][k] for q in range(world)]), mode, {}, ref_meter)
        _finish(ref_meter)
    reference = {**ref_meter.result(), "actor/lr": 1e-6}

    combined = combine_metrics(per_rank)
    assert combined.keys() == reference.keys()
    for key, want in reference.items():
        assert combined[key] == pytest.approx(want, rel=1e-7, abs=1e-12), key  # masked_mean adds 1e-8 to its divisor
    # the rules matter: a plain mean would halve the token-share metrics, a plain sum double the losses
    assert np.mean([m["actor/ppo_kl"] for m in per_rank]) != pytest.approx(reference["actor/ppo_kl"])
    assert np.sum([m["actor/pg_loss"] for m in per_rank]) != pytest.approx(reference["actor/pg_loss"])


def test_combine_metrics_refuses_disagreeing_global_values_and_key_sets():
    with pytest.raises(ValueError, match="actor/grad_norm.*identical"):
        combine_metrics([{"actor/grad_norm": 1.0}, {"actor/grad_norm": 2.0}])
    assert np.isnan(combine_metrics([{"actor/grad_norm": float("nan")}] * 2)["actor/grad_norm"])  # skipped step
    with pytest.raises(ValueError, match="rank 1"):
        combine_metrics([{"actor/pg_loss": 1.0}, {"actor/kl_loss": 1.0}])
