"""The SFT / DPO tree's role specs (`posttrain.config.sft_roles`): the actor, and a reference for DPO,
with no critic or reward model; picklable for Ray ranks; and the checkpoint fingerprint a run
computes from them equals the one SFT / DPO checkpoints were written with before the specs
(frozen below), so those checkpoints still resume."""

from __future__ import annotations

import pickle

import pytest

from posttrain.config.actor_rollout_ref import ActorConfig
from posttrain.config.sft_load import load_dpo_config, load_sft_config
from posttrain.config.sft_roles import sft_role_specs
from posttrain.checkpoint.layout import CheckpointError
from posttrain.trainer.resume import FINGERPRINT_KEY, check_compatible
from posttrain.trainer.sft_session import sft_fingerprint

# The RL defaults every SFT / DPO fingerprint holds for the keys its tree does not have.
_RL_DEFAULT_SETTINGS = {
    "critic.optim.lr": 1e-05, "data.train_batch_size": 1024, "data.max_prompt_length": 512,
    "data.max_response_length": 512, "actor_rollout_ref.rollout.n": 1, "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.clip_ratio_low": 0.2, "actor_rollout_ref.actor.clip_ratio_high": 0.2,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001, "actor_rollout_ref.actor.entropy_coeff": 0.0,
    "actor_rollout_ref.actor.loss_agg_mode": "token-mean", "actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla",
    "actor_rollout_ref.rollout.temperature": 1.0, "algorithm.use_kl_in_reward": False,
    "algorithm.kl_ctrl.kl_coef": 0.001, "algorithm.norm_adv_by_std_in_grpo": True,
    "critic.ppo_mini_batch_size": "${actor_rollout_ref.actor.ppo_mini_batch_size}",
    "critic.ppo_micro_batch_size_per_gpu": None, "data.train_files": "~/data/rlhf/gsm8k/train.parquet",
    "trainer.total_training_steps": None, "trainer.total_epochs": 30, "data.gen_batch_size": "${data.train_batch_size}",
    "algorithm.filter_groups.enable": False, "algorithm.filter_groups.metric": None,
    "algorithm.filter_groups.max_num_gen_batches": 0, "reward_model.reward_manager": "naive",
    "reward_model.overlong_buffer.enable": False, "reward_model.overlong_buffer.len": 0,
    "reward_model.overlong_buffer.penalty_factor": 0.0,
}

# What `rl_config_for` (deleted) and `resume.config_fingerprint` gave for these two configs.
FROZEN_DPO_LORA = {
    "model_path": "/models/tiny", "adv_estimator": "dpo", "critic": False, "vocab_size": 321,
    "lora": {"actor": {"lora_rank": 8, "lora_alpha": 16.0, "target_modules": ["q_proj", "v_proj"],
                       "exclude_modules": None, "lora_adapter_path": None}, "critic": None},
    "settings": {**_RL_DEFAULT_SETTINGS, "actor_rollout_ref.actor.optim.lr": 3e-06,
                 "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
                 "actor_rollout_ref.actor.use_kl_loss": True, "trainer.seed": 7},
}
FROZEN_SFT = {
    "model_path": "/models/tiny", "adv_estimator": "sft", "critic": False, "vocab_size": 99,
    "settings": {**_RL_DEFAULT_SETTINGS, "actor_rollout_ref.actor.optim.lr": 1e-05,
                 "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
                 "actor_rollout_ref.actor.use_kl_loss": False, "trainer.seed": 1},
}
DPO_LORA = ["model.partial_pretrain=/models/tiny", "model.lora_rank=8", "model.lora_alpha=16", "optim.lr=3e-6",
            "data.train_batch_size=8", "data.micro_batch_size_per_gpu=2", "trainer.seed=7",
            "model.target_modules=[q_proj,v_proj]"]


# Keys added to the fingerprint since (a checkpoint without them is compared on the rest: resume._differing_keys).
ADDED = {"async_rollouts": False}


def test_dpo_fingerprint_is_the_one_checkpoints_were_written_with():
    config = load_dpo_config(None, DPO_LORA, validate=False)
    _, driver = sft_role_specs(config, 40, reference=True)
    fingerprint = sft_fingerprint(driver, 321, "dpo")
    assert fingerprint == {**FROZEN_DPO_LORA, **ADDED}
    check_compatible({FINGERPRINT_KEY: FROZEN_DPO_LORA}, fingerprint)  # a checkpoint written before still resumes


def test_sft_fingerprint_is_the_one_checkpoints_were_written_with():
    config = load_sft_config(None, ["model.partial_pretrain=/models/tiny"], validate=False)
    _, driver = sft_role_specs(config, 10, reference=False)
    fingerprint = sft_fingerprint(driver, 99, "sft")
    assert fingerprint == {**FROZEN_SFT, **ADDED}
    check_compatible({FINGERPRINT_KEY: FROZEN_SFT}, fingerprint)
    with pytest.raises(CheckpointError, match="sft"):  # negative control: another stage's checkpoint is refused
        check_compatible({FINGERPRINT_KEY: {**FROZEN_SFT, "adv_estimator": "dpo"}}, fingerprint)


def test_sft_yields_an_actor_and_dpo_a_reference_never_a_critic_or_reward_model():
    sft, _ = sft_role_specs(load_sft_config(None, ["model.partial_pretrain=/m"], validate=False), 10, reference=False)
    dpo, _ = sft_role_specs(load_dpo_config(None, DPO_LORA, validate=False), 40, reference=True)
    assert sft.ref is None and sft.critic is None and sft.rm is None
    assert dpo.ref is not None and dpo.critic is None and dpo.rm is None
    assert dpo.ref.model is dpo.actor.model and dpo.actor.model.path == "/models/tiny"
    assert (dpo.actor.section.optim.lr, dpo.actor.section.ppo_micro_batch_size_per_gpu) == (3e-6, 2)
    assert dpo.actor.section.optim.total_training_steps == 40 and dpo.actor.rollout.name == "hf"


def test_an_rl_actor_key_reaches_sft_with_its_rl_default():
    specs, _ = sft_role_specs(load_sft_config(None, ["model.partial_pretrain=/m"], validate=False), 10,
                              reference=False)
    assert isinstance(specs.actor.section, ActorConfig)
    assert specs.actor.section.policy_loss.loss_mode == ActorConfig().policy_loss.loss_mode


def test_specs_travel_to_ranks_by_pickle():
    specs, _ = sft_role_specs(load_dpo_config(None, DPO_LORA, validate=False), 40, reference=True)
    back = pickle.loads(pickle.dumps(specs))
    assert back == specs and back.timeout_s == specs.timeout_s
