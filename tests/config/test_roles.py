"""The RL tree's role specs (`posttrain.config.roles.rl_role_specs`): each role from its own sections,
present exactly when the run asks for it."""

from __future__ import annotations

from posttrain.config import load_config
from posttrain.config.roles import rl_role_specs


def test_rl_tree_yields_each_role_it_asks_for_from_its_sections():
    config = load_config(None, ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=True",
                                "reward_model.enable=True", "reward_model.model.path=/rm"], validate=False)
    specs = rl_role_specs(config)
    arr = config.actor_rollout_ref
    assert (specs.actor.model, specs.actor.fsdp, specs.actor.section) == (arr.model, arr.actor.fsdp_config, arr.actor)
    assert (specs.ref.model, specs.ref.fsdp, specs.ref.section) == (arr.model, arr.ref.fsdp_config, arr.ref)
    assert specs.critic.section is config.critic and specs.critic.fsdp is config.critic.model.fsdp_config
    assert specs.rm.section is config.reward_model and specs.rm.model.path == "/rm"
    assert specs.timeout_s == arr.nccl_timeout


def test_grpo_without_kl_has_the_actor_alone():
    specs = rl_role_specs(load_config(None, ["algorithm.adv_estimator=grpo"], validate=False))
    assert specs.ref is None and specs.critic is None and specs.rm is None
