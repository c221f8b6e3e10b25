"""DPO losses against a plain-Python float64 reference per loss_type, properties (ln 2 at the start,
gradient signs, swapped pairs), the registry's errors, and TRL's own loss code where TRL imports."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms.dpo import (DPO_LOSS_TYPES, check_dpo_options, dpo_loss, dpo_metrics, pair_logps,
                                      register_dpo_loss, registered_dpo_losses)
from posttrain.errors import ConfigError


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _reference_loss(pc, pr, rc, rr, beta, loss_type, eps, len_c, len_r) -> float:
    """One pair's loss from the formulas, in plain float64 Python."""
    h = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        return -(1 - eps) * _log_sigmoid(beta * h) - eps * _log_sigmoid(-beta * h)
    if loss_type == "hinge":
        return max(0.0, 1.0 - beta * h)
    if loss_type == "ipo":
        h_avg = (pc - rc) / len_c - (pr - rr) / len_r
        return (h_avg - 1.0 / (2.0 * beta)) ** 2
    if loss_type == "robust":
        return (-(1 - eps) * _log_sigmoid(beta * h) + eps * _log_sigmoid(-beta * h)) / (1 - 2 * eps)
    raise AssertionError(loss_type)


def _pairs(seed: int, b: int = 7):
    g = torch.Generator().manual_seed(seed)
    ref_c = -20 - 10 * torch.rand(b, generator=g, dtype=torch.float64)
    ref_r = -20 - 10 * torch.rand(b, generator=g, dtype=torch.float64)
    pol_c = ref_c + 3 * torch.randn(b, generator=g, dtype=torch.float64)
    pol_r = ref_r + 3 * torch.randn(b, generator=g, dtype=torch.float64)
    len_c = torch.randint(1, 30, (b,), generator=g)
    len_r = torch.randint(1, 30, (b,), generator=g)
    return pol_c, pol_r, ref_c, ref_r, len_c, len_r


def _options(loss_type):
    return dict(beta=0.3, loss_type=loss_type, label_smoothing=0.2 if loss_type in ("sigmoid", "robust") else 0.0)


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "robust"])
def test_each_loss_matches_the_float64_reference(loss_type):
    pol_c, pol_r, ref_c, ref_r, len_c, len_r = _pairs(0)
    opts = _options(loss_type)
    losses, chosen_rewards, rejected_rewards = dpo_loss(pol_c, pol_r, ref_c, ref_r, chosen_lengths=len_c,
                                                        rejected_lengths=len_r, **opts)
    expected = [_reference_loss(*row, opts["beta"], loss_type, opts["label_smoothing"], lc, lr)
                for row, lc, lr in zip(zip(pol_c.tolist(), pol_r.tolist(), ref_c.tolist(), ref_r.tolist()),
                                       len_c.tolist(), len_r.tolist())]
    assert losses.dtype == torch.float64
    assert losses.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert chosen_rewards.tolist() == pytest.approx([0.3 * (p - r) for p, r in zip(pol_c.tolist(), ref_c.tolist())])
    assert rejected_rewards.tolist() == pytest.approx([0.3 * (p - r) for p, r in zip(pol_r.tolist(), ref_r.tolist())])
    # negative control: the same inputs under another beta give other losses
    wrong, _, _ = dpo_loss(pol_c, pol_r, ref_c, ref_r, chosen_lengths=len_c, rejected_lengths=len_r,
                           **{**opts, "beta": 0.31})
    assert wrong.tolist() != pytest.approx(expected, rel=1e-6)


def test_the_reference_formulas_on_a_hand_computed_pair():
    # h = (-10 - -12) - (-15 - -14) = 2 - (-1) = 3; beta = 0.5 -> beta h = 1.5
    args = (torch.tensor([-10.0]), torch.tensor([-15.0]), torch.tensor([-12.0]), torch.tensor([-14.0]))
    sig, _, _ = dpo_loss(*args, beta=0.5, loss_type="sigmoid")
    assert sig.item() == pytest.approx(math.log(1 + math.exp(-1.5)), rel=1e-6)
    hinge, _, _ = dpo_loss(*args, beta=0.5, loss_type="hinge")
    assert hinge.item() == pytest.approx(0.0)  # 1 - 1.5 < 0
    # ipo with 2 chosen and 4 rejected tokens: 2/2 - (-1)/4 = 1.25; (1.25 - 1)^2 = 0.0625
    ipo, _, _ = dpo_loss(*args, beta=0.5, loss_type="ipo", chosen_lengths=torch.tensor([2]),
                         rejected_lengths=torch.tensor([4]))
    assert ipo.item() == pytest.approx(0.0625, rel=1e-6)


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust"])
def test_no_label_smoothing_is_plain_dpo(loss_type):
    pol_c, pol_r, ref_c, ref_r, _, _ = _pairs(1)
    losses, _, _ = dpo_loss(pol_c, pol_r, ref_c, ref_r, beta=0.1, loss_type=loss_type)
    plain = [-_log_sigmoid(0.1 * ((pc - rc) - (pr - rr)))
             for pc, pr, rc, rr in zip(pol_c.tolist(), pol_r.tolist(), ref_c.tolist(), ref_r.tolist())]
    assert losses.tolist() == pytest.approx(plain, rel=1e-12)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_sigmoid_loss_is_ln2_when_the_policy_is_the_reference(eps):
    _, _, ref_c, ref_r, _, _ = _pairs(2)
    losses, chosen_rewards, rejected_rewards = dpo_loss(ref_c.clone(), ref_r.clone(), ref_c, ref_r, beta=0.1,
                                                        loss_type="sigmoid", label_smoothing=eps)
    assert losses.tolist() == pytest.approx([math.log(2)] * len(ref_c), rel=1e-12)
    assert chosen_rewards.abs().max().item() == 0.0 and rejected_rewards.abs().max().item() == 0.0
    metrics = dpo_metrics(chosen_rewards, rejected_rewards, ref_c, ref_r)
    assert metrics["rewards/accuracies"].item() == 0.0  # ties are not counted as right


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "robust"])
def test_raising_the_chosen_log_prob_lowers_the_loss(loss_type):
    """Gradient signs: d loss / d chosen < 0 and d loss / d rejected > 0 (where the loss is active),
    and a small step along them lowers the loss."""
    pol_c, pol_r, ref_c, ref_r, len_c, len_r = _pairs(3)
    pol_c = (ref_c - 1.0).requires_grad_(True)  # chosen below the reference: every loss is active
    pol_r = (ref_r + 1.0).requires_grad_(True)
    opts = _options(loss_type)
    losses, _, _ = dpo_loss(pol_c, pol_r, ref_c, ref_r, chosen_lengths=len_c, rejected_lengths=len_r, **opts)
    losses.sum().backward()
    assert (pol_c.grad < 0).all() and (pol_r.grad > 0).all()
    with torch.no_grad():
        raised, _, _ = dpo_loss(pol_c + 0.01, pol_r, ref_c, ref_r, chosen_lengths=len_c, rejected_lengths=len_r,
                                **opts)
    assert (raised < losses.detach()).all()


def test_swapping_chosen_and_rejected_flips_the_margin():
    pol_c, pol_r, ref_c, ref_r, _, _ = _pairs(4)
    losses, cr, rr = dpo_loss(pol_c, pol_r, ref_c, ref_r, beta=0.2, loss_type="sigmoid")
    swapped, cr2, rr2 = dpo_loss(pol_r, pol_c, ref_r, ref_c, beta=0.2, loss_type="sigmoid")
    # -log sigmoid(z) - (-log sigmoid(-z)) = -z, so the two losses differ by exactly beta h
    z = (cr - rr)
    assert (losses - swapped).tolist() == pytest.approx((-z).tolist(), rel=1e-10)
    assert torch.equal(cr2, rr) and torch.equal(rr2, cr)


def test_metrics_are_trl_names_and_means():
    cr = torch.tensor([0.5, -0.2, 0.1, 0.0])
    rr = torch.tensor([0.1, 0.3, -0.1, 0.0])
    pc = torch.tensor([-10.0, -11.0, -12.0, -13.0])
    pr = torch.tensor([-20.0, -21.0, -22.0, -23.0])
    m = dpo_metrics(cr, rr, pc, pr)
    assert sorted(m) == ["logps/chosen", "logps/rejected", "rewards/accuracies", "rewards/chosen", "rewards/margins",
                         "rewards/rejected"]
    assert m["rewards/chosen"].item() == pytest.approx(0.1)
    assert m["rewards/rejected"].item() == pytest.approx(0.075)
    assert m["rewards/margins"].item() == pytest.approx(0.025)
    assert m["rewards/accuracies"].item() == pytest.approx(0.5)  # pairs 0 and 2
    assert m["logps/chosen"].item() == pytest.approx(-11.5)
    assert m["logps/rejected"].item() == pytest.approx(-21.5)


def test_low_precision_inputs_are_computed_in_float32():
    pol_c, pol_r, ref_c, ref_r, _, _ = _pairs(5)
    losses, cr, _ = dpo_loss(*(t.bfloat16() for t in (pol_c, pol_r, ref_c, ref_r)), beta=0.1, loss_type="sigmoid")
    assert losses.dtype == torch.float32 and cr.dtype == torch.float32


def test_unknown_loss_type_lists_the_valid_ones():
    assert set(DPO_LOSS_TYPES) == {"sigmoid", "hinge", "ipo", "robust"}
    t = torch.zeros(2)
    with pytest.raises(ConfigError,
                       match=r"dpo.loss_type='dpo' is not a DPO loss; valid: \['hinge', 'ipo', 'robust', 'sigmoid'\]"):
        dpo_loss(t, t, t, t, beta=0.1, loss_type="dpo")


@pytest.mark.parametrize("kwargs, match", [
    (dict(beta=0.0, loss_type="sigmoid"), "dpo.beta=0.0: must be > 0"),
    (dict(beta=-1.0, loss_type="ipo"), "must be > 0"),
    (dict(beta=0.1, loss_type="ipo", label_smoothing=0.1), "no effect with dpo.loss_type='ipo'"),
    (dict(beta=0.1, loss_type="hinge", label_smoothing=0.1), r"loss that reads it: \['robust', 'sigmoid'\]"),
    (dict(beta=0.1, loss_type="robust", label_smoothing=0.5), r"must be in \[0, 0.5\)"),
    (dict(beta=0.1, loss_type="sigmoid", label_smoothing=-0.1), r"must be in \[0, 0.5\)"),
])
def test_bad_options_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        check_dpo_options(**kwargs)


def test_ipo_without_lengths_says_what_to_pass():
    t = torch.zeros(2)
    with pytest.raises(ValueError, match="pass chosen_lengths and rejected_lengths"):
        dpo_loss(t, t, t, t, beta=0.1, loss_type="ipo")


def test_registry_refuses_a_second_function_under_a_taken_name():
    assert "sigmoid" in registered_dpo_losses()
    with pytest.raises(ValueError, match="already registered"):
        register_dpo_loss("sigmoid")(lambda *a, **k: None)


# ------------------------------------------------------------------------------------------------
# TRL's own code: DPOTrainer._compute_loss on the same log-probs (TRL 1.x; skipped when it does not import)


def _trl_loss_and_metrics(loss_type, beta, eps, pol_c, pol_r, ref_c, ref_r, len_c, len_r):
    """TRL's ``_compute_loss`` with precomputed reference log-probs and a stand-in model whose per-token
    log-probs sum to ``pol_c`` / ``pol_r`` over ``len_c`` / ``len_r`` completion tokens."""
    trl = pytest.importorskip("trl.trainer.dpo_trainer")
    b = len(pol_c)
    width = 1 + int(max(len_c.max(), len_r.max()))  # one prompt token, then the completion
    lengths = torch.cat([len_c, len_r])
    completion_mask = torch.zeros(2 * b, width, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        completion_mask[i, 1:1 + n] = 1
    shift_mask = completion_mask[:, 1:].to(torch.float64)
    per_token = shift_mask * (torch.cat([pol_c, pol_r]) / lengths.to(torch.float64))[:, None]

    def model(**_):
        zeros = torch.zeros_like(per_token)
        return SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros,
                               is_top1=torch.zeros_like(per_token, dtype=torch.bool))

    identity = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t)
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=identity, aux_loss_enabled=False, precompute_ref_logps=True,
        ld_alpha=None, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta,
        label_smoothing=eps, use_weighting=False, _metrics={"train": defaultdict(list)}, _total_train_tokens=0,
        _tp_size=1)
    inputs = {"input_ids": torch.zeros(2 * b, width, dtype=torch.long), "attention_mask": torch.ones(2 * b, width),
              "completion_mask": completion_mask, "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    try:
        loss = trl.DPOTrainer._compute_loss(fake, model, inputs, False)
    except (AttributeError, TypeError, KeyError) as err:  # another TRL version's internals
        pytest.skip(f"TRL {getattr(trl, '__version__', '?')}'s _compute_loss needs other internals: {err!r}")
    return loss, {k: v[-1] for k, v in fake._metrics["train"].items()}


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "robust"])
def test_matches_trl_dpo_trainer(loss_type):
    pol_c, pol_r, ref_c, ref_r, len_c, len_r = _pairs(6, b=5)
    eps = 0.2 if loss_type == "robust" else 0.0  # TRL 1.x ignores label_smoothing with sigmoid
    trl_loss, trl_metrics = _trl_loss_and_metrics(loss_type, 0.3, eps, pol_c, pol_r, ref_c, ref_r, len_c, len_r)
    losses, cr, rr = dpo_loss(pol_c, pol_r, ref_c, ref_r, beta=0.3, loss_type=loss_type, label_smoothing=eps,
                              chosen_lengths=len_c, rejected_lengths=len_r)
    assert losses.mean().item() == pytest.approx(float(trl_loss), rel=1e-9)
    ours = {k: v.item() for k, v in dpo_metrics(cr, rr, pol_c, pol_r).items()}
    assert ours == pytest.approx({k: trl_metrics[k] for k in ours}, rel=1e-9)
    # negative control: TRL's numbers are not matched by another loss type
    other = "hinge" if loss_type != "hinge" else "sigmoid"
    other_losses, _, _ = dpo_loss(pol_c, pol_r, ref_c, ref_r, beta=0.3, loss_type=other, chosen_lengths=len_c,
                                  rejected_lengths=len_r)
    assert other_losses.mean().item() != pytest.approx(float(trl_loss), rel=1e-3)


def test_pair_logps_sums_the_interleaved_rows_over_their_masks():
    log_probs = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -9.0, -9.0], [-3.0, -1.0, -1.0], [-2.0, -2.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    chosen, rejected, len_c, len_r = pair_logps(log_probs, mask)
    assert chosen.tolist() == [-3.0, -5.0] and rejected.tolist() == [-0.5, -4.0]
    assert len_c.tolist() == [2, 3] and len_r.tolist() == [1, 2]
    with pytest.raises(ValueError, match="two by two"):
        pair_logps(log_probs[:3], mask[:3])
