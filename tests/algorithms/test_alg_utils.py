"""Masked reductions against float64 references."""

import math

import pytest
import torch

from posttrain.algorithms import masked_mean, masked_sum, masked_var, masked_whiten

TOL = dict(rtol=1e-5, atol=1e-5)


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(4, 7, generator=g)
    mask = torch.rand(4, 7, generator=g) > 0.4
    mask[0, 0] = mask[1, 1] = True
    return values, mask


def _selected(values, mask):
    return [v for v, m in zip(values.double().flatten().tolist(), mask.flatten().tolist()) if m]


def test_masked_sum_mean_var_match_reference():
    values, mask = _data()
    xs = _selected(values, mask)
    n, mean = len(xs), sum(xs) / len(xs)
    biased = sum((x - mean) ** 2 for x in xs) / n
    assert masked_sum(values, mask).item() == pytest.approx(sum(xs), abs=1e-5)
    # verl adds 1e-8 to the count
    assert masked_mean(values, mask).item() == pytest.approx(sum(xs) / (n + 1e-8), abs=1e-6)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(biased, abs=1e-5)
    assert masked_var(values, mask).item() == pytest.approx(biased * n / (n - 1), abs=1e-5)


def test_masked_mean_along_axis_and_empty_row():
    values, mask = _data(1)
    mask[2] = False  # an empty row gives 0, not NaN
    per_row = masked_mean(values, mask, axis=-1)
    for b in range(4):
        xs = _selected(values[b], mask[b])
        expected = sum(xs) / (len(xs) + 1e-8) if xs else 0.0
        assert per_row[b].item() == pytest.approx(expected, abs=1e-6)


def test_masked_whiten_matches_reference():
    values, mask = _data(2)
    xs = _selected(values, mask)
    n, mean = len(xs), sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    expected = (values.double() - mean) / math.sqrt(var + 1e-8)  # every position is transformed
    torch.testing.assert_close(masked_whiten(values, mask).double(), expected, **TOL)
    torch.testing.assert_close(masked_whiten(values, mask, shift_mean=False).double(), expected + mean, **TOL)


def test_masked_positions_never_change_results():
    values, mask = _data(3)
    moved = values + (~mask) * 1e6
    moved[~mask] = torch.where(torch.arange((~mask).sum()) % 2 == 0, float("nan"), float("inf"))
    assert torch.equal(masked_sum(values, mask), masked_sum(moved, mask))
    assert torch.equal(masked_mean(values, mask, 1), masked_mean(moved, mask, 1))


def test_unbiased_var_needs_two_elements():
    values = torch.randn(2, 3)
    one = torch.zeros(2, 3)
    one[0, 0] = 1
    with pytest.raises(ValueError, match="one element"):
        masked_var(values, one)
    with pytest.raises(ValueError, match="no element"):
        masked_var(values, torch.zeros(2, 3))
    assert masked_var(values, one, unbiased=False).item() == 0.0
