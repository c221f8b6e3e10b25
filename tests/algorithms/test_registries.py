"""verl's registry semantics, one source of truth per kind: the registry dict's entries are the registered
functions themselves; a function placed straight into the dict (as verl's own tests and verl users do)
is found like a decorated one; registering the same function twice is accepted and a different function
under a taken name is refused. What an entry declared (needs, keys) is kept beside it, by name, and
describes the entry only while it is still that function."""

import pytest
import torch

from posttrain.algorithms import advantages as adv_mod
from posttrain.algorithms import policy_losses as pl_mod
from posttrain.algorithms.advantages import EstimatorsWith, adv_estimator_spec, get_adv_estimator_fn, registered_adv_estimators
from posttrain.algorithms.policy_losses import get_policy_loss_fn, policy_loss_spec, registered_policy_losses


@pytest.fixture
def private(monkeypatch):
    """Registrations made by a test go into copies of the registries and their declarations."""
    for module, names in ((adv_mod, ("ADV_ESTIMATOR_REGISTRY", "_DECLARED")),
                          (pl_mod, ("POLICY_LOSS_REGISTRY", "_DECLARED"))):
        for name in names:
            monkeypatch.setattr(module, name, dict(getattr(module, name)))


def test_registry_entries_are_the_registered_functions():
    """verl code calls and compares the entries: ``ADV_ESTIMATOR_REGISTRY["grpo"] is compute_grpo...``."""
    assert adv_mod.ADV_ESTIMATOR_REGISTRY["grpo"] is adv_mod.compute_grpo_outcome_advantage
    assert get_adv_estimator_fn("grpo") is adv_mod.ADV_ESTIMATOR_REGISTRY["grpo"]
    assert pl_mod.POLICY_LOSS_REGISTRY["vanilla"] is pl_mod.compute_policy_loss_vanilla
    assert get_policy_loss_fn("vanilla") is pl_mod.POLICY_LOSS_REGISTRY["vanilla"]
    assert all(callable(fn) and not isinstance(fn, adv_mod.EstimatorSpec) for fn in adv_mod.ADV_ESTIMATOR_REGISTRY.values())
    # an entry called as verl calls it: GRPO of rewards 1, 0 in one group is +-1/std = +-0.7071
    adv, _ = adv_mod.ADV_ESTIMATOR_REGISTRY["grpo"](
        token_level_rewards=torch.tensor([[1.0], [0.0]]), response_mask=torch.ones(2, 1), index=["a", "a"])
    assert torch.allclose(adv.flatten(), torch.tensor([0.70710, -0.70710]), atol=1e-4)


def test_an_estimator_placed_in_the_registry_dict_is_found(private):
    def straight(**kwargs):
        return torch.zeros(1), torch.ones(1)

    assert "straight_in" not in registered_adv_estimators()
    adv_mod.ADV_ESTIMATOR_REGISTRY["straight_in"] = straight
    assert get_adv_estimator_fn("straight_in") is straight
    assert "straight_in" in registered_adv_estimators()
    spec = adv_estimator_spec("straight_in")  # declares no needs
    assert spec.fn is straight
    assert (spec.needs_critic, spec.needs_groups, spec.needs_greedy_baseline) == (False, False, False)
    assert "straight_in" not in EstimatorsWith("needs_groups")


def test_a_decorated_estimator_is_its_own_registry_entry_and_declares_its_needs(private):
    @adv_mod.register_adv_est("decorated", needs_groups=True)
    def decorated(**kwargs):
        return None, None

    assert adv_mod.ADV_ESTIMATOR_REGISTRY["decorated"] is decorated
    assert adv_mod.register_adv_est("decorated", needs_groups=True)(decorated) is decorated  # same function: accepted
    assert "decorated" in EstimatorsWith("needs_groups")
    assert "gae" not in EstimatorsWith("needs_groups")  # negative control
    with pytest.raises(ValueError, match="'decorated' is already registered"):
        adv_mod.register_adv_est("decorated")(lambda **kwargs: None)
    assert adv_mod.ADV_ESTIMATOR_REGISTRY["decorated"] is decorated  # the refused one did not replace it


def test_an_entry_replaced_straight_in_the_dict_does_not_inherit_the_old_needs(private):
    """grpo declares it needs groups; a user's function written over it in the dict declares nothing."""
    assert "grpo" in EstimatorsWith("needs_groups")

    def mine(**kwargs):
        return None, None

    adv_mod.ADV_ESTIMATOR_REGISTRY["grpo"] = mine
    assert get_adv_estimator_fn("grpo") is mine and adv_estimator_spec("grpo").fn is mine
    assert "grpo" not in EstimatorsWith("needs_groups")


def test_a_policy_loss_placed_in_the_registry_dict_is_found(private):
    def straight(*args, **kwargs):
        return torch.tensor(0.0), {}

    assert "straight_in" not in registered_policy_losses()
    pl_mod.POLICY_LOSS_REGISTRY["straight_in"] = straight
    assert get_policy_loss_fn("straight_in") is straight
    assert "straight_in" in registered_policy_losses()
    assert policy_loss_spec("straight_in").keys == ()
    assert policy_loss_spec("sapo").keys == ("tau_pos", "tau_neg")  # negative control: a declared loss


def test_a_decorated_policy_loss_is_its_own_registry_entry(private):
    @pl_mod.register_policy_loss("decorated", keys=("clip_ratio",))
    def decorated(*args, **kwargs):
        return torch.tensor(0.0), {}

    assert pl_mod.POLICY_LOSS_REGISTRY["decorated"] is decorated
    assert pl_mod.register_policy_loss("decorated", keys=("clip_ratio",))(decorated) is decorated
    assert policy_loss_spec("decorated").keys == ("clip_ratio",)
    with pytest.raises(ValueError, match="'decorated' is already registered"):
        pl_mod.register_policy_loss("decorated")(lambda *a, **k: None)
