"""Policy losses, agg_loss and the value loss against hand cases and float64 loop references."""

import math
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_entropy_loss,
    compute_value_loss,
    entropy_from_logits,
    get_policy_loss_fn,
    register_policy_loss,
    registered_policy_losses,
)
from posttrain.algorithms import policy_losses as pl_mod

TOL = dict(rtol=1e-5, atol=1e-5)


def _config(**overrides):
    policy_loss = SimpleNamespace(
        loss_mode="vanilla", clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0, kl_cov_ratio=0.0002,
        ppo_kl_coef=0.1, dro_beta=0.3, rollout_correction=SimpleNamespace(loss_type="ppo_clip"),
    )
    fields = dict(
        clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05,
        loss_agg_mode="token-mean", policy_loss=policy_loss,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def _batch(seed, batch=5, length=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    old = torch.randn(batch, length, generator=g) * 0.5 - 1.0
    new = old + torch.randn(batch, length, generator=g) * 0.4
    adv = torch.randn(batch, length, generator=g)
    return old, new, adv, mask


def _agg_ref(loss, mask, mode, factor=None):
    """Float64 loop reference of the aggregation modes (local normalisation)."""
    rows = [[(l, m) for l, m in zip(lr, mr)] for lr, mr in zip(loss.double().tolist(), mask.tolist())]
    if mode == "token-mean":
        return sum(l * m for r in rows for l, m in r) / sum(m for r in rows for _, m in r)
    if mode == "token-sum":
        return sum(l * m for r in rows for l, m in r)
    nonempty = [r for r in rows if sum(m for _, m in r) > 0]
    if mode == "seq-mean-token-mean":
        return sum(sum(l * m for l, m in r) / sum(m for _, m in r) for r in nonempty) / len(nonempty)
    seq_sum = sum(sum(l * m for l, m in r) for r in nonempty) / len(nonempty)
    return seq_sum / (factor or loss.shape[-1]) if mode == "seq-mean-token-sum-norm" else seq_sum


# --------------------------------------------------------------------------------- agg_loss


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_matches_reference(mode):
    _, _, loss, mask = _batch(0)
    mask[2] = 0.0  # an empty row is excluded from the seq-mean modes
    assert agg_loss(loss, mask, mode).item() == pytest.approx(_agg_ref(loss, mask, mode), abs=1e-5)
    moved = loss + (1 - mask) * 1e3  # masked positions never matter
    assert torch.equal(agg_loss(loss, mask, mode), agg_loss(moved, mask, mode))


def test_agg_loss_hand_case():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)  # (1+2+3+4)/4
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)  # (6+4)/2
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)  # (2+4)/2
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(5.0 / 3)  # / response_len
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=10).item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        agg_loss(loss, mask, "mean")
    for mode in ("token-mean", "seq-mean-token-mean"):  # several ranks need global counts
        with pytest.raises(ValueError, match="required when dp_size > 1"):
            agg_loss(loss, mask, mode, dp_size=2)
    assert agg_loss(loss, mask, "token-mean", dp_size=2, batch_num_tokens=8).item() == pytest.approx(10 / 8 * 2)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_global_normaliser_makes_micro_batches_sum_to_the_mini_batch(mode):
    _, _, loss, mask = _batch(1, batch=6)
    full = agg_loss(loss, mask, mode)
    tokens, seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    parts = [
        agg_loss(loss[s], mask[s], mode, batch_num_tokens=tokens, global_batch_size=seqs)
        for s in (slice(0, 2), slice(2, 6))
    ]
    torch.testing.assert_close(parts[0] + parts[1], full, **TOL)


# --------------------------------------------------------------------------------- PPO clip


def test_vanilla_hand_case_with_dual_clip():
    # eps_low 0.2, eps_high 0.28, c = 3; old_logp = 0 so r = exp(logp)
    #  r=1.5 A=+1: max(-1.5, -1.28) = -1.28        (clipped)
    #  r=0.5 A=+1: max(-0.5, -0.8)  = -0.5
    #  r=0.5 A=-1: max(0.5, 0.8) = 0.8, min(3, 0.8) = 0.8   (clipped)
    #  r=5.0 A=-1: max(5.0, 1.28) = 5.0, min(3, 5.0) = 3    (dual-clipped)
    #  5th token masked out with absurd values
    # token-mean: (-1.28 - 0.5 + 0.8 + 3) / 4 = 0.505
    ratios = torch.tensor([[1.5, 0.5, 0.5, 5.0, 100.0]])
    logp, old = ratios.log(), torch.zeros(1, 5)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    loss, metrics = get_policy_loss_fn("vanilla")(old, logp, adv, mask, "token-mean", _config())
    assert loss.item() == pytest.approx(0.505, abs=1e-6)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in metrics.values())
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(0.25)
    assert metrics["actor/ppo_kl"].item() == pytest.approx(-math.log(1.5 * 0.5 * 0.5 * 5.0) / 4, abs=1e-6)


def _vanilla_ref(old, new, adv, low, high, c):
    out = []
    for o_row, n_row, a_row in zip(old.double().tolist(), new.double().tolist(), adv.double().tolist()):
        row = []
        for o, n, a in zip(o_row, n_row, a_row):
            r = math.exp(max(min(n - o, 20.0), -20.0))
            l_ppo = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
            row.append(min(l_ppo, -a * c) if a < 0 else l_ppo)
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_vanilla_matches_reference(mode):
    old, new, adv, mask = _batch(2)
    weights = torch.rand(old.shape, generator=torch.Generator().manual_seed(9)) + 0.5
    config = _config(clip_ratio_low=None, clip_ratio_high=0.3)  # low falls back to clip_ratio
    loss, _ = get_policy_loss_fn("vanilla")(old, new, adv, mask, mode, config, rollout_is_weights=weights)
    ref = _agg_ref(_vanilla_ref(old, new, adv, 0.2, 0.3, 3.0) * weights.double(), mask, mode)
    assert loss.item() == pytest.approx(ref, abs=1e-5)


def test_vanilla_uses_global_batch_info_and_rejects_bad_dual_clip():
    old, new, adv, mask = _batch(3)
    config = _config(global_batch_info={"batch_num_tokens": 100, "dp_size": 2})
    loss, _ = get_policy_loss_fn("vanilla")(old, new, adv, mask, "token-mean", config)
    ref = (_vanilla_ref(old, new, adv, 0.2, 0.28, 3.0) * mask.double()).sum().item() / 100 * 2
    assert loss.item() == pytest.approx(ref, abs=1e-5)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        get_policy_loss_fn("vanilla")(old, new, adv, mask, "token-mean", _config(clip_ratio_c=1.0))


# --------------------------------------------------------------------------------- other losses


def _seq_log_ratio(old, new, mask):
    return [
        sum((n - o) * m for o, n, m in zip(orow, nrow, mrow)) / max(sum(mrow), 1)
        for orow, nrow, mrow in zip(old.double().tolist(), new.double().tolist(), mask.tolist())
    ]


def test_gspo_matches_reference_and_gradient():
    old, new, adv, mask = _batch(4)
    new = new.clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn("gspo")(old, new, adv, mask, "seq-mean-token-mean", _config())
    seq = _seq_log_ratio(old, new.detach(), mask)
    ref = torch.tensor(
        [[max(-a * math.exp(min(s, 10.0)), -a * min(max(math.exp(min(s, 10.0)), 0.8), 1.28)) for a in arow]
         for s, arow in zip(seq, adv.double().tolist())],
        dtype=torch.float64,
    )
    assert loss.item() == pytest.approx(_agg_ref(ref, mask, "seq-mean-token-mean"), abs=1e-5)
    assert metrics["actor/pg_clipfrac_lower"].item() == 0.0
    # the token ratio is sg(s_i) * pi / sg(pi), so d ratio / d logp_t = s_i on the unclipped branch
    # and 0 where the clipped branch wins; seq-mean-token-mean divides by n_i and the row count
    (grad,) = torch.autograd.grad(loss, new)
    n_rows = (mask.sum(-1) > 0).sum().item()
    for b, s in enumerate(seq):
        ratio = math.exp(min(s, 10.0))
        for t in range(mask.shape[1]):
            a = adv[b, t].item()
            unclipped_wins = -a * ratio >= -a * min(max(ratio, 0.8), 1.28)
            expected = -a * ratio / mask[b].sum().item() / n_rows if (mask[b, t] and unclipped_wins) else 0.0
            assert grad[b, t].item() == pytest.approx(expected, abs=1e-6)


def test_gpg_loss_is_plain_policy_gradient():
    old, new, adv, mask = _batch(5)
    loss, metrics = get_policy_loss_fn("gpg")(old, new, adv, mask, "token-mean", _config())
    assert metrics == {}
    assert loss.item() == pytest.approx(_agg_ref(-new.double() * adv.double(), mask, "token-mean"), abs=1e-6)


def _cov_ref(adv, new, mask):
    sel = mask.bool()
    a, lp = adv.double(), new.double()
    return (a - a[sel].mean()) * (lp - lp[sel].mean())


def test_clip_cov_cuts_every_candidate_when_the_budget_allows():
    old, new, adv, mask = _batch(6, batch=8, length=8)
    adv = adv * 3
    config = _config(policy_loss=SimpleNamespace(clip_cov_ratio=1.0, clip_cov_lb=0.2, clip_cov_ub=5.0))
    loss, metrics = get_policy_loss_fn("clip_cov")(old, new, adv, mask, "token-mean", config)
    ratio = (new - old).double().exp()
    l1, l2 = -adv.double() * ratio, -adv.double() * ratio.clamp(0.8, 1.28)
    cov = _cov_ref(adv, new, mask)
    cut = (cov > 0.2) & (cov < 5.0) & (mask > 0) & ~(l2 > l1)
    assert 0 < cut.sum() < mask.sum()
    ref = _agg_ref(torch.maximum(l1, l2) * (~cut), mask, "token-mean")
    assert loss.item() == pytest.approx(ref, abs=1e-5)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(cut.sum().item() / mask.sum().item(), abs=1e-6)


def test_kl_cov_penalises_top_covariance_tokens():
    old, new, adv, mask = _batch(7, batch=8, length=8)
    n_valid = int(mask.sum())
    config = _config(policy_loss=SimpleNamespace(kl_cov_ratio=0.25, ppo_kl_coef=0.5))
    loss, metrics = get_policy_loss_fn("kl_cov")(old, new, adv, mask, "token-mean", config)
    cov = _cov_ref(adv, new, mask)
    valid_cov = sorted(cov[mask > 0].tolist(), reverse=True)
    threshold = valid_cov[int(n_valid * 0.25) - 1]
    chosen = (cov >= threshold) & (mask > 0)
    lr = (new - old).double()
    losses = -adv.double() * lr.exp() + 0.5 * lr.abs() * chosen
    assert loss.item() == pytest.approx(_agg_ref(losses, mask, "token-mean"), abs=1e-5)
    assert metrics["actor/ppo_kl"].item() == pytest.approx((lr.abs() * mask).sum().item() / n_valid, abs=1e-6)


def test_geo_mean_cispo_sapo_match_references():
    old, new, adv, mask = _batch(8)
    cfg = _config()
    lr, a, m = (new - old).double(), adv.double(), mask.double()
    # GMPO: sign-wise clipped log-ratio, geometric mean per sequence, mean over sequences
    clamped = lr.clamp(-0.2, 0.28)
    lr_min = torch.sign(a) * torch.minimum(torch.sign(a) * lr, torch.sign(a) * clamped)
    n = m.sum(-1)
    ref = (-(a * m).sum(-1) / n * ((lr_min * m).sum(-1) / n).exp()).mean()
    loss, _ = get_policy_loss_fn("geo_mean")(old, new, adv, mask, "token-mean", cfg)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-5)
    # CISPO: -clip(r) * A * logp
    loss, _ = get_policy_loss_fn("cispo")(old, new, adv, mask, "token-mean", cfg)
    ref = _agg_ref(-lr.exp().clamp(0.8, 1.28) * a * new.double(), mask, "token-mean")
    assert loss.item() == pytest.approx(ref, abs=1e-5)
    # SAPO: gate sigmoid(tau (r - 1)) * 4 / tau, always seq-mean-token-mean
    tau = torch.where(a > 0, 1.0, 1.05).double()
    gate = torch.sigmoid(tau * (lr.exp() - 1)) * 4 / tau
    loss, _ = get_policy_loss_fn("sapo")(old, new, adv, mask, "token-mean", cfg)
    assert loss.item() == pytest.approx(_agg_ref(-gate * a, mask, "seq-mean-token-mean"), abs=1e-5)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "sapo",
                                  "dppo_tv", "dppo_kl", "dro", "bypass_mode"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_masked_positions_never_change_policy_losses(name, mode):
    old, new, adv, mask = _batch(10, batch=6, length=7)
    noise = torch.randn(old.shape) * (1 - mask)
    options = dict(clip_cov_ratio=0.5, clip_cov_lb=0.0, clip_cov_ub=5.0, kl_cov_ratio=0.3, ppo_kl_coef=0.1,
                   dro_beta=0.5, rollout_correction=SimpleNamespace(
                       loss_type="reinforce", rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"))
    cfg = _config(policy_loss=SimpleNamespace(**options))
    fn = get_policy_loss_fn(name)
    torch.manual_seed(0)
    loss_a, metrics_a = fn(old, new, adv, mask, mode, cfg)
    torch.manual_seed(0)
    loss_b, metrics_b = fn(old + noise * 5, new - noise * 3, adv + noise * 7, mask, mode, cfg)
    assert torch.equal(loss_a, loss_b)
    assert metrics_a.keys() == metrics_b.keys()
    for key in metrics_a:
        assert torch.equal(torch.as_tensor(metrics_a[key]), torch.as_tensor(metrics_b[key])), key


# --------------------------------------------------------------------------------- DPPO, DRO, bypass mode


def _dppo_ref(old, new, adv, low, high, c, kind):
    """Float64 per-token DPPO losses (value; the gradient's form is -A * sg[min(r, c)] * d logp)."""
    out, kept = [], []
    for o_row, n_row, a_row in zip(old.double().tolist(), new.double().tolist(), adv.double().tolist()):
        row, keep_row = [], []
        for o, n, a in zip(o_row, n_row, a_row):
            p, q = math.exp(n), math.exp(o)
            if kind == "tv":
                keep = p - q <= high if a > 0 else p - q >= -low
            else:
                kl = q * (o - n) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
                keep = (kl <= high or p <= q) if a > 0 else (kl <= low or p >= q)
            r = math.exp(max(min(n - o, 20.0), -20.0))
            row.append(-a * min(r, c) * n if keep else 0.0)
            keep_row.append(float(keep))
        out.append(row)
        kept.append(keep_row)
    return torch.tensor(out, dtype=torch.float64), torch.tensor(kept, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_dppo_matches_reference_and_gradient(kind, mode):
    old, new, adv, mask = _batch(11, batch=8, length=7)
    old, new = old.clamp(max=-0.05), (old + (new - old) * 2).clamp(max=-0.05)  # probabilities < 1, some far moves
    config = _config(clip_ratio_low=0.05, clip_ratio_high=0.08 if kind == "tv" else 0.02, clip_ratio_c=1.5)
    new = new.clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn(f"dppo_{kind}")(old, new, adv, mask, mode, config)
    ref, kept = _dppo_ref(old, new.detach(), adv, 0.05, config.clip_ratio_high, 1.5, kind)
    valid = mask.double()
    assert 0 < (kept * valid).sum() < valid.sum()  # the bound leaves some tokens out
    assert loss.item() == pytest.approx(_agg_ref(ref, mask, mode), abs=1e-6)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(((1 - kept) * valid).sum().item() / valid.sum().item())
    truncated = ((new.detach() - old).double().exp() > 1.5).double() * kept
    truncated_share = (truncated * valid).sum().item() / valid.sum().item()
    assert metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(truncated_share)
    # gradient: the ratio is a constant weight, so d loss / d logp_t = -A * min(r, c) * keep times the
    # aggregation's weight of token t (1 / tokens, or 1 / (row tokens * rows))
    (grad,) = torch.autograd.grad(loss, new)
    per_token = -adv.double() * (new.detach() - old).double().exp().clamp(max=1.5) * kept
    lengths = mask.double().sum(-1, keepdim=True)
    share = 1 / mask.sum() if mode == "token-mean" else 1 / (lengths.clamp(min=1) * (lengths > 0).sum())
    torch.testing.assert_close(grad.double(), per_token * mask.double() * share, rtol=1e-5, atol=1e-6)


def test_dppo_hand_case():
    # old prob 0.5 everywhere; bounds 0.1 (TV), truncation c = 1.2
    #  p=0.55 A=+1: change +0.05 <= 0.1 kept, r = 1.1  -> -1 * 1.1 * log 0.55
    #  p=0.70 A=+1: change +0.20 > 0.1 left out        -> 0
    #  p=0.70 A=-1: change +0.20 >= -0.1 kept, r = 1.4 truncated to 1.2 -> +1 * 1.2 * log 0.7
    #  p=0.30 A=-1: change -0.20 < -0.1 left out       -> 0
    new = torch.tensor([[0.55, 0.70, 0.70, 0.30]]).log()
    old, adv, mask = torch.full((1, 4), 0.5).log(), torch.tensor([[1.0, 1.0, -1.0, -1.0]]), torch.ones(1, 4)
    config = _config(clip_ratio_low=0.1, clip_ratio_high=0.1, clip_ratio_c=1.2)
    loss, metrics = get_policy_loss_fn("dppo_tv")(old, new, adv, mask, "token-sum", config)
    assert loss.item() == pytest.approx(-1.1 * math.log(0.55) + 1.2 * math.log(0.7), abs=1e-6)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(0.5)  # two of four left out
    assert metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(0.25)  # one kept token truncated


def test_dro_matches_reference_and_needs_a_positive_beta():
    old, new, adv, mask = _batch(12)
    lr = (new - old).double()
    for beta in (0.3, 2.0):
        config = _config(policy_loss=SimpleNamespace(dro_beta=beta))
        loss, metrics = get_policy_loss_fn("dro")(old, new, adv, mask, "token-mean", config)
        ref = _agg_ref(-(new.double() * adv.double() - 0.5 * beta * lr.square()), mask, "token-mean")
        assert loss.item() == pytest.approx(ref, abs=1e-6)
    assert set(metrics) == {"actor/ppo_kl"}
    # hand case: logp = -1, old = -1.5, A = 2, beta 0.5: -(-1 * 2 - 0.25 * 0.25) = 2.0625
    one = torch.ones(1, 1)
    loss, _ = get_policy_loss_fn("dro")(-1.5 * one, -one, 2 * one, one, "token-mean",
                                        _config(policy_loss=SimpleNamespace(dro_beta=0.5)))
    assert loss.item() == pytest.approx(2.0625)
    for beta in (None, 0.0, -1.0):
        with pytest.raises(ValueError, match="dro_beta must be > 0"):
            get_policy_loss_fn("dro")(old, new, adv, mask, "token-mean",
                                      _config(policy_loss=SimpleNamespace(dro_beta=beta)))


def _bypass_config(**correction):
    return _config(policy_loss=SimpleNamespace(rollout_correction=SimpleNamespace(**correction)))


def test_bypass_mode_ppo_clip_is_vanilla_against_the_rollout_policy():
    old, new, adv, mask = _batch(13)  # old: the rollout engine's log-probs
    weights = torch.full(old.shape, 7.0)  # ignored: bypass mode computes its own
    loss, metrics = get_policy_loss_fn("bypass_mode")(old, new, adv, mask, "token-mean",
                                                      _bypass_config(loss_type="ppo_clip"), rollout_is_weights=weights)
    ref = _agg_ref(_vanilla_ref(old, new, adv, 0.2, 0.28, 3.0), mask, "token-mean")
    assert loss.item() == pytest.approx(ref, abs=1e-5)
    assert {"actor/pg_clipfrac", "actor/ppo_kl", "rollout_corr/kl"} <= set(metrics)


def test_bypass_mode_reinforce_weights_and_rejects_against_the_current_policy():
    old, new, adv, mask = _batch(14, batch=8, length=7)
    new = new.clone().requires_grad_(True)
    config = _bypass_config(loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.3,
                            rollout_rs="token_k1", rollout_rs_threshold="0.6_1.6")
    loss, metrics = get_policy_loss_fn("bypass_mode")(old, new, adv, mask, "token-mean", config)
    ratio = (new.detach() - old).double().exp()  # current / rollout: the importance weight
    # token_k1's "lower_upper" bounds the k1 statistic log(rollout / current) as a ratio: rollout / current
    kept = mask.double() * ((1 / ratio >= 0.6) & (1 / ratio <= 1.6)).double()
    assert 0 < kept.sum() < mask.sum()
    w = ratio.clamp(max=1.3)
    ref = _agg_ref(-w * adv.double() * new.detach().double(), kept, "token-mean")
    assert loss.item() == pytest.approx(ref, abs=1e-5)
    (grad,) = torch.autograd.grad(loss, new)  # the weights carry no gradient: d/dlogp = -w * A / kept tokens
    torch.testing.assert_close(grad.double(), -w * adv.double() * kept / kept.sum(), rtol=1e-5, atol=1e-6)
    assert metrics["actor/ppo_kl"].item() == pytest.approx(((old - new.detach()).double() * kept).sum().item()
                                                           / kept.sum().item(), abs=1e-6)
    # negative control: without the rejection every token counts
    loss_all, _ = get_policy_loss_fn("bypass_mode")(old, new, adv, mask, "token-mean", _bypass_config(
        loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.3))
    assert loss_all.item() != pytest.approx(loss.item(), abs=1e-5)
    with pytest.raises(ValueError, match="needs policy_loss.rollout_correction"):
        get_policy_loss_fn("bypass_mode")(old, new, adv, mask, "token-mean", _config(policy_loss=SimpleNamespace()))
    with pytest.raises(ValueError, match="loss_type='ppo'"):
        get_policy_loss_fn("bypass_mode")(old, new, adv, mask, "token-mean", _bypass_config(loss_type="ppo"))


def _private_registry(monkeypatch):
    """This test's registrations go into copies of the registry and its declarations."""
    for name in ("POLICY_LOSS_REGISTRY", "_DECLARED"):
        monkeypatch.setattr(pl_mod, name, dict(getattr(pl_mod, name)))


def test_policy_loss_registry_rules(monkeypatch):
    _private_registry(monkeypatch)

    def mine(*args, **kwargs):
        return torch.tensor(0.0), {}

    register_policy_loss("mine")(mine)
    register_policy_loss("mine")(mine)
    assert get_policy_loss_fn("mine") is mine
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("mine")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="unknown policy loss mode 'ppo'.*'vanilla'"):
        get_policy_loss_fn("ppo")
    assert {"vanilla", "gspo", "gpg", "clip_cov", "kl_cov"} <= set(registered_policy_losses())


# --------------------------------------------------------------------------------- value / entropy


def test_value_loss_hand_case():
    # cliprange 0.2 around old values 0:
    #  vpred 0.5, return 1: unclipped 0.25, clipped (0.2 - 1)^2 = 0.64 -> 0.64 (clipped counts)
    #  vpred -0.1, return 0: both 0.01 -> 0.01
    #  third token masked
    # 0.5 * token-mean = 0.5 * (0.64 + 0.01) / 2 = 0.1625, clipfrac 1/2
    vpreds, returns = torch.tensor([[0.5, -0.1, 9.0]]), torch.tensor([[1.0, 0.0, -9.0]])
    values, mask = torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]])
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    assert loss.item() == pytest.approx(0.1625, abs=1e-6)
    assert clipfrac.item() == pytest.approx(0.5, abs=1e-6)
    loss, _ = compute_value_loss(vpreds, returns, values, mask, 0.2, "token-mean", batch_num_tokens=4)
    assert loss.item() == pytest.approx(0.5 * 0.65 / 4, abs=1e-6)


def test_entropy_loss_aggregates_token_entropy():
    logits = torch.tensor([[[0.0, 0.0], [0.0, 100.0]]])  # entropies ln 2 and ~0
    mask = torch.ones(1, 2)
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[math.log(2), 0.0]]), **TOL)
    assert compute_entropy_loss(logits, mask).item() == pytest.approx(math.log(2) / 2, abs=1e-6)


def test_a_policy_loss_declares_the_keys_it_reads(monkeypatch):
    """The keys a loss reads are declared with its registration: validation refuses a loss whose keys
    the config lacks (sapo's tau_pos/tau_neg) before any model loads, and `posttrain diff` describes it."""
    from posttrain.algorithms import policy_loss_spec
    from posttrain.config import ConfigError, load_config
    from posttrain.diff import consequences

    _private_registry(monkeypatch)
    builtin = "posttrain/config/builtin.yaml"
    assert policy_loss_spec("sapo").keys == ("tau_pos", "tau_neg")
    sapo = load_config(base=builtin, overrides=["actor_rollout_ref.actor.policy_loss.loss_mode=sapo",
                                                "actor_rollout_ref.actor.tau_pos=2.0"])
    assert sapo.actor_rollout_ref.actor.tau_pos == 2.0
    # bypass_mode reads policy_loss.rollout_correction, which verl's trainer fills in and posttrain's config lacks
    with pytest.raises(ConfigError, match=r"loss_mode=bypass_mode reads actor_rollout_ref.actor.policy_loss"
                                          r".rollout_correction"):
        load_config(base=builtin, overrides=["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"])
    with pytest.raises(ConfigError, match=r"loss_mode=dro needs actor_rollout_ref.actor.policy_loss.dro_beta > 0, "
                                          r"got None"):
        load_config(base=builtin, overrides=["actor_rollout_ref.actor.policy_loss.loss_mode=dro"])
    load_config(base=builtin, overrides=["actor_rollout_ref.actor.policy_loss.loss_mode=dro",
                                         "actor_rollout_ref.actor.policy_loss.dro_beta=0.1"])

    @register_policy_loss("mine_with_key", keys=("policy_loss.no_such_key",), summary="my loss")
    def mine(*args, **kwargs):
        return torch.tensor(0.0), {}

    with pytest.raises(ConfigError, match="reads actor_rollout_ref.actor.policy_loss.no_such_key"):
        load_config(base=builtin, overrides=["actor_rollout_ref.actor.policy_loss.loss_mode=mine_with_key"])
    a = load_config(base=builtin)
    b = load_config(base=builtin, overrides=["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"])
    assert any("policy loss: A uses vanilla, PPO clipped surrogate" in c and "B uses gspo, GSPO" in c
               for c in consequences(a, b))


def test_loss_scale_factor_divides_seq_mean_token_sum_norm():
    """verl 0.9.1's actor/critic.loss_scale_factor: seq-mean-token-sum-norm is the mean over sequences of their token
    sums divided by the factor (hand value), and without it by the response length (the control)."""
    from types import SimpleNamespace

    from posttrain.algorithms.losses import agg_loss, with_loss_scale_factor

    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    info = {"dp_size": 1, "batch_num_tokens": 4, "global_batch_size": 2}
    scaled = agg_loss(loss, mask, "seq-mean-token-sum-norm", **with_loss_scale_factor(info, SimpleNamespace(loss_scale_factor=5.0)))
    default = agg_loss(loss, mask, "seq-mean-token-sum-norm", **with_loss_scale_factor(info, SimpleNamespace(loss_scale_factor=None)))
    assert scaled.item() == pytest.approx((6.0 + 4.0) / 2 / 5.0)
    assert default.item() == pytest.approx((6.0 + 4.0) / 2 / 4.0)
