"""KL estimators and controllers."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms import (
    KL_PENALTY_TYPES,
    AdaptiveKLController,
    FixedKLController,
    get_kl_controller,
    kl_penalty,
)


def test_kl_estimators_hand_values():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    # d = logp - ref = [0.5, -1.0]
    torch.testing.assert_close(kl_penalty(logp, ref, "kl"), torch.tensor([[0.5, -1.0]]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[0.5, -1.0]]))
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), torch.tensor([[0.5, 1.0]]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([[0.125, 0.5]]))
    # k3 with x = ref - logp = [-0.5, 1.0]: e^x - x - 1
    k3 = torch.tensor([[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]])
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), k3)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), k3)
    torch.testing.assert_close(kl_penalty(logp, ref, "mse"), kl_penalty(logp, ref, "k2"))


def test_low_var_kl_clamps():
    logp = torch.tensor([0.0, 0.0, -30.0])
    ref = torch.tensor([5.0, -30.0, 0.0])
    out = kl_penalty(logp, ref, "k3")
    # x = 5: e^5 - 6 = 142.4 -> clamped to 10; x = -30 -> clamped to -20: e^-20 + 19 -> 10; x = 30 -> 20 -> 10
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0, 10.0]))
    small = kl_penalty(torch.tensor([0.0]), torch.tensor([2.0]), "k3")
    assert small.item() == pytest.approx(math.exp(2.0) - 3.0, rel=1e-6)


def test_straight_through_keeps_value_and_takes_k2_gradient():
    logp = torch.tensor([-1.0, -0.2, -3.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -2.0])
    for name in ("k1", "k3", "abs", "low_var_kl"):
        out = kl_penalty(logp, ref, name + "+")
        torch.testing.assert_close(out, kl_penalty(logp, ref, name))
        (grad,) = torch.autograd.grad(out.sum(), logp)
        torch.testing.assert_close(grad, (logp - ref).detach())  # d/dx 0.5 (x - ref)^2


def test_full_kl_from_distributions():
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(2, 3, 5, generator=g), -1)
    ref = torch.log_softmax(torch.randn(2, 3, 5, generator=g), -1)
    expected = torch.zeros(2, 3, dtype=torch.float64)
    for b in range(2):
        for t in range(3):
            for v in range(5):
                p = math.exp(logp[b, t, v].item())
                expected[b, t] += p * (logp[b, t, v].item() - ref[b, t, v].item())
    torch.testing.assert_close(kl_penalty(logp, ref, "full").double(), expected, rtol=1e-5, atol=1e-6)
    assert (kl_penalty(logp, ref, "full") >= -1e-6).all()
    with pytest.raises(ValueError, match="full log-prob distributions"):
        kl_penalty(logp[..., 0], ref[..., 0], "full")


def test_unknown_kl_type_lists_valid_names():
    with pytest.raises(ValueError, match="unknown kl penalty 'k4'.*low_var_kl"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")
    assert {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full", "k3+"} <= set(KL_PENALTY_TYPES)


def test_adaptive_controller_update_and_state():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.5, horizon=100)
    ctrl.update(current_kl=0.6, n_steps=10)  # error 0.6/0.5 - 1 = 0.2 -> 0.1 * (1 + 0.2 * 10 / 100)
    assert ctrl.value == pytest.approx(0.1 * 1.02)
    ctrl.update(current_kl=5.0, n_steps=10)  # error 9 clipped to 0.2
    assert ctrl.value == pytest.approx(0.1 * 1.02 * 1.02)
    ctrl.update(current_kl=0.0, n_steps=50)  # error -1 clipped to -0.2 -> * 0.9
    assert ctrl.value == pytest.approx(0.1 * 1.02 * 1.02 * 0.9)
    state = json.loads(json.dumps(ctrl.state_dict()))
    fresh = AdaptiveKLController(init_kl_coef=1.0, target_kl=0.5, horizon=100)
    fresh.load_state_dict(state)
    assert fresh.value == ctrl.value


def test_fixed_controller_and_factory():
    fixed = get_kl_controller(SimpleNamespace(type="fixed", kl_coef=0.05, target_kl=0.1, horizon=10000))
    assert isinstance(fixed, FixedKLController)
    fixed.update(current_kl=3.0, n_steps=100)
    assert fixed.value == 0.05
    restored = FixedKLController(0.0)
    restored.load_state_dict(json.loads(json.dumps(fixed.state_dict())))
    assert restored.value == 0.05
    adaptive = get_kl_controller({"type": "adaptive", "kl_coef": 0.2, "target_kl": 0.1, "horizon": 10})
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.2
    with pytest.raises(ValueError, match="horizon"):
        get_kl_controller(SimpleNamespace(type="adaptive", kl_coef=0.2, target_kl=0.1, horizon=0))
    with pytest.raises(ValueError, match="fixed' or 'adaptive"):
        get_kl_controller(SimpleNamespace(type="pid", kl_coef=0.2, target_kl=0.1, horizon=1))
