"""Distillation losses: every loss mode of verl 0.9.1 against verl's functions (transcribed in
`verl_distillation_ref`; verl's own code too where ``POSTTRAIN_VERL_SRC`` names an unpacked wheel: see
`test_distillation_verl_source.py`), each against a hand-computed float64 case, with negative controls."""

import math
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms import distillation as dist
from posttrain.algorithms.distillation import (ESTIMATOR_LOSS_MODES, DistillationScores, combine_with_policy_loss,
                                               distillation_loss, distillation_loss_spec, distillation_token_losses,
                                               forward_kl_topk, register_distillation_loss,
                                               registered_distillation_losses, sampled_token_metrics, topk_log_probs)
from posttrain.algorithms.losses import LOSS_AGG_MODES
from tests.algorithms import verl_distillation_ref as ref

ALL_MODES = ("forward_kl_topk",) + ESTIMATOR_LOSS_MODES


def _loss_config(**overrides):
    values = dict(loss_mode="k3", topk=4, use_task_rewards=False, distillation_loss_coef=1.0, loss_max_clamp=None,
                  log_prob_min_clamp=None, use_policy_gradient=False, policy_loss_mode="vanilla", clip_ratio=0.2,
                  clip_ratio_low=0.2, clip_ratio_high=0.28)
    values.update(overrides)
    return SimpleNamespace(**values)


def _batch(seed, b=4, r=6, vocab=11, k=4, holes=True):
    """Student and teacher logits ``[B, R, V]``, sampled tokens, a response mask with a short row and an
    empty-after-EOS tail, old log-probs near the new ones, the teacher's top-k ids and log-probs."""
    g = torch.Generator().manual_seed(seed)
    student_logits = torch.randn(b, r, vocab, generator=g, dtype=torch.float64) * 2
    teacher_logits = torch.randn(b, r, vocab, generator=g, dtype=torch.float64) * 2
    tokens = torch.randint(0, vocab, (b, r), generator=g)
    mask = torch.ones(b, r, dtype=torch.float64)
    if holes:
        mask[1, 3:] = 0
        mask[2, 5:] = 0
    s_lp = torch.log_softmax(student_logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    t_lp = torch.log_softmax(teacher_logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    old = s_lp + 0.3 * torch.randn(b, r, generator=g, dtype=torch.float64)
    t_all = torch.log_softmax(teacher_logits, -1)
    t_topk_lp, t_topk_ids = torch.topk(t_all, k, dim=-1)
    return SimpleNamespace(student_logits=student_logits, s_lp=s_lp, t_lp=t_lp, old=old, mask=mask,
                           t_topk_lp=t_topk_lp, t_topk_ids=t_topk_ids, tokens=tokens)


def _close(ours, theirs, name="", tol=1e-12):
    torch.testing.assert_close(torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(theirs, dtype=torch.float64),
                               rtol=tol * 100, atol=tol, msg=lambda m: f"{name}: {m}")


def _global_info(mask, mode):
    return {} if mode == "token-mean" else {"loss_scale_factor": 5.0} if mode == "seq-mean-token-sum-norm" else {}


# ---------------------------------------------------------------------------------------------- against verl


@pytest.mark.parametrize("loss_mode", ESTIMATOR_LOSS_MODES)
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("pg", [False, True])
@pytest.mark.parametrize("clamp", [None, 0.7])
def test_estimator_modes_equal_verl(loss_mode, agg, pg, clamp):
    if loss_mode in ("kl", "k1") and not pg:
        pytest.skip("verl refuses k1 as a supervised loss (its gradient does not depend on the teacher)")
    x = _batch(seed=ESTIMATOR_LOSS_MODES.index(loss_mode) * 10 + LOSS_AGG_MODES.index(agg))
    cfg = _loss_config(loss_mode=loss_mode, use_policy_gradient=pg, loss_max_clamp=clamp)
    weights = torch.rand(x.s_lp.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.5
    info = _global_info(x.mask, agg)

    s_ours = x.s_lp.clone().requires_grad_(True)
    losses, metrics = distillation_token_losses(loss_mode, DistillationScores(s_ours, x.t_lp, x.mask))
    loss, loss_metrics = distillation_loss(losses, x.mask, agg, loss_max_clamp=clamp, use_policy_gradient=pg,
                                           log_prob=s_ours, old_log_prob=x.old, policy_config=cfg,
                                           rollout_is_weights=weights if pg else None, global_batch_info=info)
    s_ref = x.s_lp.clone().requires_grad_(True)
    ref_losses, ref_metrics = ref.compute_distillation_loss_reverse_kl_estimator(s_ref, x.t_lp, x.mask, loss_mode)
    ref_loss, ref_metrics = ref.distillation_loss(ref_losses, ref_metrics, x.mask, agg, cfg, info, log_prob=s_ref,
                                                  old_log_prob=x.old, rollout_is_weights=weights if pg else None)
    _close(losses * x.mask, ref_losses * x.mask, "per-token losses")
    _close(loss, ref_loss, "loss")
    (grad,), (ref_grad,) = torch.autograd.grad(loss, s_ours), torch.autograd.grad(ref_loss, s_ref)
    _close(grad, ref_grad, "gradient")
    for name, value in ref_metrics.items():
        _close(({**metrics, **loss_metrics})[name], value, name)


@pytest.mark.parametrize("min_clamp", [None, -1.5])
@pytest.mark.parametrize("pg", [False, True])
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_forward_kl_topk_equals_verl(min_clamp, pg, agg):
    x = _batch(seed=7 + LOSS_AGG_MODES.index(agg))
    cfg = _loss_config(loss_mode="forward_kl_topk", use_policy_gradient=pg, loss_max_clamp=0.9,
                       log_prob_min_clamp=min_clamp)
    logits = x.student_logits.clone().requires_grad_(True)
    s_topk = topk_log_probs(logits, x.t_topk_ids)
    student_ids = torch.topk(logits.detach(), 4, dim=-1).indices
    s_lp = torch.log_softmax(logits, -1).gather(-1, x.tokens[..., None]).squeeze(-1)
    scores = DistillationScores(s_lp, x.t_lp, x.mask, s_topk, x.t_topk_lp, x.t_topk_ids, student_ids)
    losses, metrics = distillation_token_losses("forward_kl_topk", scores, min_clamp)
    loss, loss_metrics = distillation_loss(losses, x.mask, agg, loss_max_clamp=0.9, use_policy_gradient=pg,
                                           log_prob=s_lp, old_log_prob=x.old, policy_config=cfg)

    ref_logits = x.student_logits.clone().requires_grad_(True)
    out = ref.fsdp_compute_forward_kl_topk(ref_logits, x.t_topk_lp, x.t_topk_ids, min_clamp)
    ref_losses, ref_metrics = ref.compute_forward_kl_topk(out, x.mask, 4)
    ref_s_lp = torch.log_softmax(ref_logits, -1).gather(-1, x.tokens[..., None]).squeeze(-1)
    ref_loss, ref_metrics = ref.distillation_loss(ref_losses, ref_metrics, x.mask, agg, cfg, {}, log_prob=ref_s_lp,
                                                  old_log_prob=x.old)
    assert torch.equal(student_ids, out["student_topk_ids"])
    _close(losses * x.mask, ref_losses * x.mask, "per-token losses")
    _close(loss, ref_loss, "loss")
    (grad,), (ref_grad,) = torch.autograd.grad(loss, logits), torch.autograd.grad(ref_loss, ref_logits)
    _close(grad, ref_grad, "gradient")
    for name, value in ref_metrics.items():
        _close(({**metrics, **loss_metrics})[name], value, name)


@pytest.mark.parametrize("use_task_rewards", [False, True])
@pytest.mark.parametrize("pg", [False, True])
def test_combination_with_the_task_rewards_loss_equals_verl(use_task_rewards, pg):
    cfg = _loss_config(use_task_rewards=use_task_rewards, use_policy_gradient=pg, distillation_loss_coef=0.25)
    distill, ppo = torch.tensor(0.8, dtype=torch.float64), torch.tensor(-1.3, dtype=torch.float64)
    ours = combine_with_policy_loss(distill, ppo, use_task_rewards=use_task_rewards, distillation_loss_coef=0.25)
    _close(ours, ref.distillation_ppo_loss(distill, ppo, cfg))
    # hand: with task rewards -1.3 + 0.25 * 0.8 = -1.1; without, the distillation loss alone, coefficient 1
    _close(ours, -1.1 if use_task_rewards else 0.8)


def test_negative_controls_other_modes_and_swapped_roles_do_not_match_verl():
    x = _batch(seed=11)
    theirs, _ = ref.compute_distillation_loss_reverse_kl_estimator(x.s_lp, x.t_lp, x.mask, "k3")
    for other in ("k1", "abs", "k2"):
        ours, _ = distillation_token_losses(other, DistillationScores(x.s_lp, x.t_lp, x.mask))
        assert not torch.allclose(ours * x.mask, theirs * x.mask, atol=1e-3)
    swapped, _ = distillation_token_losses("k3", DistillationScores(x.t_lp, x.s_lp, x.mask))  # teacher as student
    assert not torch.allclose(swapped * x.mask, theirs * x.mask, atol=1e-3)
    # top-k: the student's log-probs of its OWN top-k (not the teacher's tokens) give another loss
    out = ref.fsdp_compute_forward_kl_topk(x.student_logits, x.t_topk_lp, x.t_topk_ids, None)
    wrong_ids = torch.topk(x.student_logits, 4, dim=-1).indices
    wrong, _, _ = forward_kl_topk(topk_log_probs(x.student_logits, wrong_ids), x.t_topk_lp)
    assert not torch.allclose(wrong * x.mask, out["distillation_losses"] * x.mask, atol=1e-3)


# ---------------------------------------------------------------------------------------------- by hand


def test_estimator_modes_hand_case_float64():
    # student log-probs s, teacher log-probs t; d = s - t = [0.5, -1.0, 30.0]
    s = torch.tensor([[-1.0, -2.0, 0.0]], dtype=torch.float64)
    t = torch.tensor([[-1.5, -1.0, -30.0]], dtype=torch.float64)
    mask = torch.ones_like(s)
    expected = {
        "k1": [0.5, -1.0, 30.0],
        "abs": [0.5, 1.0, 30.0],
        "k2": [0.125, 0.5, 450.0],
        # k3: x = t - s = [-0.5, 1.0, -30 -> clamped to -20]; e^x - x - 1, the result clamped at 10
        "k3": [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 2.0, 10.0],
    }
    aliases = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
    for mode in ESTIMATOR_LOSS_MODES:
        losses, metrics = distillation_token_losses(mode, DistillationScores(s, t, mask))
        want = torch.tensor([expected[aliases.get(mode, mode)]], dtype=torch.float64)
        _close(losses, want, mode)
        _close(metrics["distillation/abs_loss"], want.abs().mean(), mode)


def test_forward_kl_topk_hand_case_float64():
    # one token, k = 2. teacher p = [0.5, 0.25] (log 0.5, log 0.25), student q = [0.25, 0.5] on those tokens
    # KL = 0.5 (log 0.5 - log 0.25) + 0.25 (log 0.25 - log 0.5) = 0.25 log 2
    t = torch.log(torch.tensor([[[0.5, 0.25]]], dtype=torch.float64))
    s = torch.log(torch.tensor([[[0.25, 0.5]]], dtype=torch.float64))
    kl, s_mass, t_mass = forward_kl_topk(s, t)
    _close(kl, [[0.25 * math.log(2)]], tol=1e-7)  # the sum runs in float32, as verl's kl_divergence
    _close(s_mass, [[0.75]])
    _close(t_mass, [[0.75]])
    # log_prob_min_clamp = log 0.4 lifts log 0.25 on both sides: teacher [0.5, 0.4], student [0.4, 0.5]
    # KL = 0.5 log(0.5 / 0.4) + 0.4 log(0.4 / 0.5) = 0.1 log 1.25; masses measured before the clamp
    kl, s_mass, _ = forward_kl_topk(s, t, log_prob_min_clamp=math.log(0.4))
    _close(kl, [[0.1 * math.log(1.25)]], tol=1e-7)
    _close(s_mass, [[0.75]])
    # a negative top-k divergence is clamped at 0 by the registered loss: the student has more mass on both tokens
    s_big = torch.log(torch.tensor([[[0.6, 0.3]]], dtype=torch.float64))
    raw, _, _ = forward_kl_topk(s_big, t)  # 0.5 log(5/6) + 0.25 log(5/6) < 0
    _close(raw, [[0.75 * math.log(5 / 6)]], tol=1e-7)
    losses, _ = distillation_token_losses("forward_kl_topk", DistillationScores(None, None, torch.ones(1, 1),
                                                                                s_big, t))
    _close(losses, [[0.0]])


def test_topk_log_probs_is_log_softmax_at_the_ids():
    logits = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    z = math.log(math.exp(1) + math.exp(2) + math.exp(3))
    _close(topk_log_probs(logits, torch.tensor([[2, 0]])), [[3 - z, 1 - z]])


def test_supervised_and_policy_gradient_hand_case():
    # two tokens, k3 losses computed by hand; token-mean
    s = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 2.0]  # 0.1065, 0.7183
    losses, _ = distillation_token_losses("k3", DistillationScores(s, t, mask))
    # supervised, clamp 0.5: [0.1065, 0.5] -> mean; d/ds k3 = 1 - e^(t - s) on the unclamped token, 0 on the clamped
    loss, metrics = distillation_loss(losses, mask, "token-mean", loss_max_clamp=0.5)
    _close(loss, (k3[0] + 0.5) / 2)
    _close(metrics["distillation/clamped_frac"], 0.5)
    _close(metrics["distillation/loss_max"], k3[1])
    (grad,) = torch.autograd.grad(loss, s)
    _close(grad, [[(1 - math.exp(-0.5)) / 2, 0.0]])
    # policy gradient, on-policy (old = new, ratio 1): loss = mean(-A * 1) with A = -k3, so the loss value is the
    # mean k3, and its gradient is -A * ratio * d log s = k3 / 2 per token (the losses themselves are detached)
    losses, _ = distillation_token_losses("k3", DistillationScores(s, t, mask))
    cfg = _loss_config()
    loss, metrics = distillation_loss(losses, mask, "token-mean", use_policy_gradient=True, log_prob=s,
                                      old_log_prob=s.detach(), policy_config=cfg)
    _close(loss, sum(k3) / 2)
    (grad,) = torch.autograd.grad(loss, s)
    _close(grad, [[k3[0] / 2, k3[1] / 2]])
    assert {"distillation/pg_clipfrac", "distillation/ppo_kl", "distillation/pg_clipfrac_lower"} <= set(metrics)


def test_sampled_token_metrics_hand_case():
    s = torch.tensor([[-1.0, -2.0, -9.0]])
    t = torch.tensor([[-1.5, -1.0, -0.1]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    m = sampled_token_metrics(s, t, mask)
    assert m["distillation/reverse_kl"].item() == pytest.approx((0.5 - 1.0) / 2)
    assert m["distillation/student_log_prob"].item() == pytest.approx(-1.5)
    assert m["distillation/teacher_log_prob"].item() == pytest.approx(-1.25)


# ---------------------------------------------------------------------------------------------- properties, registry


@pytest.mark.parametrize("loss_mode", ALL_MODES)
def test_masked_positions_never_change_the_loss(loss_mode):
    x = _batch(seed=5)
    junk = x.mask == 0

    def run(s_lp, t_lp, t_topk_lp):
        scores = DistillationScores(s_lp, t_lp, x.mask, topk_log_probs(x.student_logits, x.t_topk_ids), t_topk_lp,
                                    x.t_topk_ids)
        losses, _ = distillation_token_losses(loss_mode, scores)
        return distillation_loss(losses, x.mask, "token-mean", loss_max_clamp=5.0)[0]

    base = run(x.s_lp, x.t_lp, x.t_topk_lp)
    garbage = run(torch.where(junk, torch.tensor(-1e4, dtype=torch.float64), x.s_lp),
                  torch.where(junk, torch.tensor(7.0, dtype=torch.float64), x.t_lp),
                  torch.where(junk[..., None], torch.tensor(3.0, dtype=torch.float64), x.t_topk_lp))
    _close(garbage, base)


def test_registry_lists_verls_modes_and_refuses_bad_registrations(monkeypatch):
    assert set(registered_distillation_losses()) == set(ALL_MODES)
    assert distillation_loss_spec("forward_kl_topk").use_topk and not distillation_loss_spec("k3").use_topk
    assert distillation_loss_spec("k1").use_estimator
    with pytest.raises(ValueError, match=r"unknown distillation loss mode 'k4'.*forward_kl_topk"):
        distillation_loss_spec("k4")
    monkeypatch.setattr(dist, "_REGISTRY", dict(dist._REGISTRY))
    with pytest.raises(ValueError, match="already registered"):
        register_distillation_loss("k3", use_estimator=True)(lambda *a: None)
    with pytest.raises(ValueError, match="exactly one"):
        register_distillation_loss("both", use_topk=True, use_estimator=True)
    register_distillation_loss("mine", use_estimator=True)(lambda s, m, c: (s.student_log_probs * 0, {}))
    assert "mine" in registered_distillation_losses()
