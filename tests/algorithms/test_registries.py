"""One registry per kind: a function placed straight into the registry dict (as verl's own registry
tests and verl users do) is as registered as one added with the decorator."""

import torch

from posttrain.algorithms import advantages as adv_mod
from posttrain.algorithms import policy_losses as pl_mod
from posttrain.algorithms.advantages import (EstimatorsWith, adv_estimator_spec, get_adv_estimator_fn,
                                             registered_adv_estimators)
from posttrain.algorithms.policy_losses import get_policy_loss_fn, policy_loss_spec, registered_policy_losses


def test_an_estimator_placed_in_the_registry_dict_is_found(monkeypatch):
    def straight(**kwargs):
        return torch.zeros(1), torch.ones(1)

    assert "straight_in" not in registered_adv_estimators()
    monkeypatch.setitem(adv_mod.ADV_ESTIMATOR_REGISTRY, "straight_in", straight)
    assert get_adv_estimator_fn("straight_in") is straight
    assert "straight_in" in registered_adv_estimators()
    spec = adv_estimator_spec("straight_in")  # declares no needs
    assert (spec.needs_critic, spec.needs_groups, spec.needs_greedy_baseline) == (False, False, False)
    assert "straight_in" not in EstimatorsWith("needs_groups")
    # a registered entry is called like its function (verl code calls registry values directly)
    adv, _ = adv_mod.ADV_ESTIMATOR_REGISTRY["grpo"](
        token_level_rewards=torch.tensor([[1.0], [0.0]]), response_mask=torch.ones(2, 1),
        index=["a", "a"])
    want, _ = get_adv_estimator_fn("grpo")(token_level_rewards=torch.tensor([[1.0], [0.0]]),
                                           response_mask=torch.ones(2, 1), index=["a", "a"])
    assert torch.equal(adv, want)


def test_a_decorated_estimator_is_in_the_registry_dict(monkeypatch):
    monkeypatch.setattr(adv_mod, "_ADV_ESTIMATORS", dict(adv_mod._ADV_ESTIMATORS))

    @adv_mod.register_adv_est("decorated", needs_groups=True)
    def decorated(**kwargs):
        return None, None

    assert adv_mod._ADV_ESTIMATORS["decorated"].fn is decorated
    assert "decorated" in EstimatorsWith("needs_groups")
    assert "gae" not in EstimatorsWith("needs_groups")  # negative control


def test_a_policy_loss_placed_in_the_registry_dict_is_found(monkeypatch):
    def straight(*args, **kwargs):
        return torch.tensor(0.0), {}

    assert "straight_in" not in registered_policy_losses()
    monkeypatch.setitem(pl_mod.POLICY_LOSS_REGISTRY, "straight_in", straight)
    assert get_policy_loss_fn("straight_in") is straight
    assert "straight_in" in registered_policy_losses()
    assert policy_loss_spec("straight_in").keys == ()
