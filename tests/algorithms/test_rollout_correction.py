"""algorithm.rollout_correction: importance weights, rejection and diagnostics on hand-computed cases
(ratios chosen so every number is exact: r = p_old / p_rollout in {0.25, 0.5, 1, 2, 3})."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms.rollout_correction import (apply_rollout_correction, check_rollout_correction_config,
                                                     offpolicy_metrics, rollout_is_weights, rollout_rejection_mask)


def _log_ratio(rows):
    return torch.log(torch.tensor(rows, dtype=torch.float64))


def _cfg(**kw):
    base = dict(rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False, rollout_rs=None,
                rollout_rs_threshold=None, bypass_mode=False, loss_type="ppo_clip")
    base.update(kw)
    return SimpleNamespace(**base)


def test_token_is_weights_truncate_and_report_untruncated_stats():
    # one response, ratios 2, 0.5, 3 and a padding position (ratio 7, ignored)
    lr = _log_ratio([[2.0, 0.5, 3.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w, m = rollout_is_weights(lr, mask, "token", threshold=2.5)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 2.5, 0.0]], dtype=torch.float64))
    assert m["rollout_is_mean"] == pytest.approx(5.5 / 3)  # before truncation
    assert m["rollout_is_max"] == pytest.approx(3.0) and m["rollout_is_min"] == pytest.approx(0.5)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)  # 3 > 2.5
    assert m["rollout_is_ratio_fraction_low"] == 0.0  # nothing below 1 / 2.5 = 0.4
    # std / ESS use the weights clipped to [0.4, 2.5]: 2, 0.5, 2.5 (mean 5/3)
    mean = 5 / 3
    assert m["rollout_is_std"] == pytest.approx(math.sqrt((4 + 0.25 + 6.25) / 3 - mean ** 2))
    normalized = [x / mean for x in (2.0, 0.5, 2.5)]
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1 / (sum(x * x for x in normalized) / 3))
    assert m["rollout_is_seq_mean"] == pytest.approx(5.5 / 3)
    assert m["rollout_is_seq_max_deviation"] == pytest.approx(5.5 / 3 - 1)


def test_sequence_is_weight_is_the_truncated_product():
    # response 0: ratios 2 and 0.5 (product 1); response 1: one token of ratio 3 (product 3 -> 2)
    lr = _log_ratio([[2.0, 0.5], [3.0, 1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    w, m = rollout_is_weights(lr, mask, "sequence", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0], [2.0, 0.0]], dtype=torch.float64))
    assert m["rollout_is_max"] == pytest.approx(3.0) and m["rollout_is_min"] == pytest.approx(1.0)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(0.5)  # one response of two above 2
    assert m["rollout_is_mean"] == pytest.approx((1 + 1 + 3) / 3)  # token mean of the untruncated weights


def test_is_batch_normalize_divides_by_the_mean_weight():
    lr = _log_ratio([[2.0, 0.5, 3.0]])
    w, m = rollout_is_weights(lr, torch.ones(1, 3), "token", threshold=2.5, batch_normalize=True)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(5 / 3)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 2.5]], dtype=torch.float64) * 3 / 5)


def test_token_k1_rejection_keeps_ratios_inside_the_bounds():
    lr = _log_ratio([[2.0, 0.5, 3.0, 0.25]])
    mask = torch.ones(1, 4, dtype=torch.long)
    new_mask, m = rollout_rejection_mask(lr, mask, "token_k1", "0.5_2.0")
    assert new_mask.tolist() == [[1, 1, 0, 0]] and new_mask.dtype == torch.long
    assert m["rollout_rs_token_k1_masked_fraction"] == pytest.approx(0.5)
    assert m["rollout_rs_masked_fraction"] == pytest.approx(0.5)
    assert m["rollout_rs_seq_masked_fraction"] == 1.0
    # k1 = -log r = [-ln2, ln2, -ln3, ln4]; bounds [ln 0.5, ln 2]: ln4 is high, -ln3 low
    assert m["rollout_rs_token_k1_fraction_high"] == pytest.approx(0.25)
    assert m["rollout_rs_token_k1_fraction_low"] == pytest.approx(0.25)
    assert m["rollout_rs_token_k1_max"] == pytest.approx(math.log(4))


def test_one_number_k1_threshold_means_reciprocal_bounds():
    lr = _log_ratio([[2.0, 0.5, 3.0, 0.25]])
    a, _ = rollout_rejection_mask(lr, torch.ones(1, 4), "token_k1", 2.0)
    b, _ = rollout_rejection_mask(lr, torch.ones(1, 4), "token_k1", "0.5_2.0")
    assert torch.equal(a, b)


def test_seq_mean_k3_rejects_whole_responses_and_options_combine():
    # k3 = r - 1 - ln r: r=2 -> 1 - ln2 = 0.3069, r=0.5 -> ln2 - 0.5 = 0.1931, r=1 -> 0
    lr = _log_ratio([[2.0, 0.5], [1.0, 1.0]])
    mask = torch.ones(2, 2)
    new_mask, m = rollout_rejection_mask(lr, mask, "seq_mean_k3", 0.2)
    assert new_mask.tolist() == [[0, 0], [1, 1]]  # mean 0.25 > 0.2 drops response 0
    assert m["rollout_rs_seq_mean_k3_seq_max"] == pytest.approx(0.25)
    assert m["rollout_rs_seq_mean_k3_seq_masked_fraction"] == pytest.approx(0.5)
    # with token_k2 as well (0.5 ln^2 2 = 0.240 > 0.1): response 0 is out either way, response 1 stays
    both, m2 = rollout_rejection_mask(lr, mask, "seq_mean_k3,token_k2", "0.2,0.1")
    assert both.tolist() == [[0, 0], [1, 1]]
    assert m2["rollout_rs_token_k2_masked_fraction"] == pytest.approx(0.5)


def test_offpolicy_metrics_hand_case():
    old = torch.log(torch.tensor([[0.5, 0.2]]))
    rollout = torch.log(torch.tensor([[0.25, 0.4]]))  # ratios 2 and 0.5
    m = offpolicy_metrics(old, rollout, torch.ones(1, 2))
    assert m["kl"] == pytest.approx(((math.log(0.25) - math.log(0.5)) + (math.log(0.4) - math.log(0.2))) / 2, abs=1e-6)
    assert m["k3_kl"] == pytest.approx(((2 - 1 - math.log(2)) + (0.5 - 1 + math.log(2))) / 2, abs=1e-6)
    assert m["chi2_token"] == pytest.approx((4 + 0.25) / 2 - 1, abs=1e-5)
    assert m["chi2_seq"] == pytest.approx(0.0, abs=1e-5)  # product of ratios is 1
    assert m["training_ppl"] == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.2)) / 2), rel=1e-5)


def test_apply_rollout_correction_names_and_passthrough():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    rollout = torch.log(torch.tensor([[0.25, 0.4, 0.3]]))
    mask = torch.ones(1, 3, dtype=torch.long)
    weights, new_mask, m = apply_rollout_correction(old, rollout, mask, _cfg())
    assert weights is None and new_mask is mask  # metrics only
    assert "rollout_corr/kl" in m and not any("rollout_is" in k for k in m)
    weights, new_mask, m = apply_rollout_correction(old, rollout, mask, _cfg(rollout_is="token", rollout_is_threshold=2.5,
                                                                             rollout_rs="token_k1",
                                                                             rollout_rs_threshold="0.4_2.5"))
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5, 2.5]]))
    assert new_mask.tolist() == [[1, 1, 0]]
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(5.5 / 3, rel=1e-5)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("kw, logprobs, match", [
    (dict(rollout_is="token"), False, "calculate_log_probs"),
    (dict(rollout_is="tokens"), True, "rollout_is='tokens'"),
    (dict(rollout_rs="token_k1"), True, "rollout_rs_threshold"),
    (dict(rollout_rs="token_k9", rollout_rs_threshold=2.0), True, "token_k9"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="0.1_2"), True, "one upper bound"),
    (dict(bypass_mode=True, loss_type="reinforce"), True, "not implemented"),
    (dict(bypass_mode=True, rollout_is="token"), True, "bypass_mode=true with rollout_is"),
])
def test_config_errors_name_the_key(kw, logprobs, match):
    with pytest.raises(ValueError, match=match):
        check_rollout_correction_config(_cfg(**kw), calculate_log_probs=logprobs)
    check_rollout_correction_config(_cfg(), calculate_log_probs=False)  # defaults need nothing
