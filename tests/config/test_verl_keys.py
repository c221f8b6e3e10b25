"""verl 0.9.1's keys: every key of its PPO and engine-SFT trees is known here (honoured, an alias, an entry of a
dict key, no effect with a reason, or refused unless off), and each kind does what it says."""

from __future__ import annotations

import pytest
import torch

from posttrain.config import load_config
from posttrain.config import verl_keys
from posttrain.config.load import RL_TREE, Tree, verl_key_status
from posttrain.config.sft_engine import engine_sft_tree
from posttrain.errors import ConfigError

GRPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.train_batch_size=4", "actor_rollout_ref.actor.use_kl_loss=True"]


@pytest.mark.parametrize("name, tree, count", [("ppo_trainer", RL_TREE, 829),
                                               ("sft_trainer_engine", engine_sft_tree(), 180)])
def test_every_verl_key_is_known(name, tree, count):
    keys = verl_keys.verl_key_names(name)
    assert len(keys) == count and len(set(keys)) == count  # the recorded list is whole
    unknown = [k for k in keys if verl_key_status(k, tree)[0] == "unknown"]
    assert not unknown, f"{len(unknown)} verl 0.9.1 keys unknown to posttrain, e.g. {unknown[:10]}"


def test_the_check_can_fail():
    """A key verl does not have is unknown; without its rule, a no-effect key of verl's is unknown too."""
    assert verl_key_status("actor_rollout_ref.actor.no_such_key")[0] == "unknown"
    assert verl_key_status("global_profiler.tool")[0] == "no effect"
    bare = Tree(no_effect=tuple(r for r in verl_keys.NO_EFFECT if not r.pattern.endswith("profiler.*")))
    assert verl_key_status("global_profiler.tool", bare)[0] == "unknown"


def test_no_effect_keys_are_kept_and_listed_with_their_reason():
    config = load_config(overrides=[*GRPO, "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096",
                                    "transfer_queue.enable=True", "actor_rollout_ref.actor.fsdp_config.entropy_checkpointing=True"])
    assert sorted(config.no_effect) == sorted([
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096",
        "transfer_queue.enable=True", "actor_rollout_ref.actor.fsdp_config.entropy_checkpointing=True"])
    lines = verl_keys.no_effect_lines(config.no_effect)
    assert len(lines) == 3 and any("TransferQueue" in line for line in lines)
    from posttrain.config import find_problems

    assert any("checkpoint_engine" in w for w in find_problems(config)[1])  # posttrain plan's warnings


@pytest.mark.parametrize("override, needle", [
    ("actor_rollout_ref.model.mtp.enable=True", "multi-token prediction training needs verl's Megatron engine"),
    ("actor_rollout_ref.rollout.disaggregation.enabled=True", "SGLang"),
    ("actor_rollout_ref.actor.fsdp_config.qat.enable=True", "quantization-aware"),
    ("actor_rollout_ref.model.lora.rank=16", "set model.lora_rank"),
    ("actor_rollout_ref.actor.strategy=megatron", "Megatron-LM"),
    ("actor_rollout_ref.rollout.name=trtllm", "TensorRT-LLM"),
    ("trainer.device=npu", "Ascend"),
    ("trainer.v1.separate_async.hybrid_rollout.enable_switch=True", "V1 separate_async engine"),
])
def test_refused_values_name_what_they_need(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(overrides=[*GRPO, override])
    off = override.rsplit("=", 1)[0] + "=" + {"True": "False", "16": "0", "4": "1"}.get(override.rsplit("=", 1)[1], "x")
    if not off.endswith("=x"):
        load_config(overrides=[*GRPO, off])  # the off value has no effect


def test_aliases_set_posttrains_key():
    config = load_config(validate=False, overrides=[*GRPO, "critic.fsdp.param_offload=True", "sandbox_fusion.url=http://x:1",
                                    "+actor_rollout_ref.actor.policy_loss.tau_pos=2.5", "rollout.n_gpus_per_node=3",
                                    "reward_model.reward_loop_source=importlib"])
    assert config.critic.model.fsdp_config.param_offload is True
    assert config.reward.sandbox_fusion.url == "http://x:1"
    assert config.actor_rollout_ref.actor.tau_pos == 2.5  # where verl's SAPO scripts write it
    assert config.actor_rollout_ref.rollout.n_gpus_per_node == 3  # verl's async configs size the pool here
    assert config.reward.reward_manager.source == "importlib"


@pytest.mark.parametrize("mode, hybrid, staleness, sync_step", [("sync", True, 0.1, 1), ("colocate_async", False, 1, 1),
                                                                  ("separate_async", False, 8, 4)])
def test_trainer_modes_map_onto_posttrains_runs(mode, hybrid, staleness, sync_step):
    config = load_config(validate=False, overrides=[*GRPO, f"trainer.v1.trainer_mode={mode}"])
    assert config.actor_rollout_ref.hybrid_engine is hybrid
    assert (config.async_training.staleness_threshold, config.async_training.trigger_parameter_sync_step) == (
        staleness, sync_step)
    if not hybrid:
        assert config.actor_rollout_ref.rollout.n_gpus_per_node >= 1


def test_an_explicit_async_key_wins_over_the_mode_and_use_v1_false_is_sync():
    config = load_config(validate=False, overrides=[*GRPO, "trainer.v1.trainer_mode=separate_async",
                                                    "async_training.staleness_threshold=2"])
    assert config.async_training.staleness_threshold == 2 and config.async_training.trigger_parameter_sync_step == 4
    config = load_config(validate=False, overrides=[*GRPO, "trainer.use_v1=False",
                                                    "trainer.v1.trainer_mode=separate_async"])
    assert config.actor_rollout_ref.hybrid_engine is True
    with pytest.raises(ConfigError, match="trainer.v1.trainer_mode='fast' is not one of: sync, colocate_async"):
        load_config(overrides=[*GRPO, "trainer.v1.trainer_mode=fast"])


def test_optimizer_impl_builds_the_named_class():
    """verl's optim.optimizer_impl / optimizer / override_optimizer_config: SGD from torch.optim gets no betas
    (verl's rule), AdamW gets override's eps; a module that does not import is one error naming the key."""
    from types import SimpleNamespace

    from posttrain.optim.build import build_optimizer, optimizer_kind

    params = list(torch.nn.Linear(3, 2).parameters())
    common = dict(lr=0.1, betas=[0.9, 0.99], weight_decay=0.0)
    sgd = build_optimizer(params, SimpleNamespace(optimizer="SGD", optimizer_impl="torch.optim",
                                                  override_optimizer_config={"momentum": 0.5}, **common))
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.5
    adamw = build_optimizer(params, SimpleNamespace(optimizer="AdamW", optimizer_impl="torch.optim",
                                                    override_optimizer_config={"eps": 1e-6}, **common))
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["eps"] == 1e-6
    missing = SimpleNamespace(optimizer="AdamW8bit", optimizer_impl="no_such_optim_lib", override_optimizer_config=None,
                              **common)
    assert optimizer_kind(missing) == "external"
    with pytest.raises(ValueError, match="optimizer_impl=no_such_optim_lib\\) needs no_such_optim_lib"):
        build_optimizer(params, missing)


def test_library_names_mean_the_library_as_in_transformers():
    """adamw_8bit / adamw_bnb_8bit are bitsandbytes' AdamW8bit, adamw_torch_8bit torchao's (transformers'
    OptimizerNames); posttrain's own format has its own name. Where the library is missing: one error naming it
    and posttrain's own."""
    import importlib.util
    from types import SimpleNamespace

    from posttrain.optim.adamw8bit import AdamW8bit
    from posttrain.optim.build import OWN_8BIT, build_optimizer, optimizer_kind

    params = list(torch.nn.Linear(3, 2).parameters())
    common = dict(lr=0.1, betas=[0.9, 0.99], weight_decay=0.0, optimizer_impl="torch.optim", override_optimizer_config=None)
    assert isinstance(build_optimizer(params, SimpleNamespace(optimizer=OWN_8BIT, **common)), AdamW8bit)
    ours = SimpleNamespace(**{**common, "optimizer": "AdamW8bit", "optimizer_impl": "posttrain.optim"})
    assert optimizer_kind(ours) == "adamw_8bit"
    for name, library in (("adamw_8bit", "bitsandbytes"), ("adamw_bnb_8bit", "bitsandbytes"),
                          ("adamw_torch_8bit", "torchao")):
        optim = SimpleNamespace(optimizer=name, **common)
        assert optimizer_kind(optim) == "external"
        if importlib.util.find_spec(library) is None:
            with pytest.raises(ValueError, match=f"needs {library}.*{OWN_8BIT}"):
                build_optimizer(params, optim)
        else:
            assert type(build_optimizer(params, optim)).__module__.startswith(library)


def test_reward_loop_model_without_a_function_is_the_discriminative_reward_model():
    """verl 0.9's reward.reward_model.enable=True with no reward function scores with the model's classification
    head (examples/grpo_trainer/run_mistral_nemo_12b_skyworkrm_fsdp.sh): posttrain's DisRM on the workers, batched by
    tokens as verl's server is; with a function it stays the GenRM judge (the control)."""
    loop = ["reward.reward_model.enable=True", "reward.reward_model.model_path=Skywork/Skywork-Reward-Llama-3.1-8B",
            "reward.reward_model.rollout.prompt_length=1024", "reward.reward_model.rollout.response_length=512"]
    config = load_config(overrides=[*GRPO, *loop])
    rm = config.reward_model
    assert rm.enable and rm.model.path == "Skywork/Skywork-Reward-Llama-3.1-8B" and not config.reward.reward_model.enable
    assert rm.use_dynamic_bsz and rm.forward_max_token_len_per_gpu == 1536
    judged = load_config(validate=False, overrides=[*GRPO, *loop, "reward.custom_reward_function.path=judge.py"])
    assert judged.reward.reward_model.enable and not judged.reward_model.enable
