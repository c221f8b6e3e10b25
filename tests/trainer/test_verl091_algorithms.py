"""verl 0.9.1's estimators and losses in posttrain's run: configs shaped like verl's example scripts pass the
config check (examples/gdpo_trainer, otb_trainer, sapo_trainer, dppo_trainer), and tiny runs train 2 steps with
gdpo (a scoring function returning a dict of two reward parts) and optimal_token_baseline."""

import copy
import math

import numpy as np
import pytest
import torch

from helpers.tiny_run import one_thread, tiny_trainer
from posttrain.algorithms import get_adv_estimator_fn
from posttrain.config import ConfigError, load_config

# the parts of verl's GRPO-family example scripts every one of them sets (Qwen3-8B, 8 GPUs, vLLM)
VERL_SCRIPT = [
    "data.train_files=/data/train.parquet", "data.val_files=/data/test.parquet", "data.train_batch_size=128",
    "data.max_prompt_length=2048", "data.max_response_length=2048", "data.filter_overlong_prompts=True",
    "data.truncation=error", "actor_rollout_ref.model.path=Qwen/Qwen3-8B",
    "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
    "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576",
    "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True", "trainer.balance_batch=True", "trainer.critic_warmup=0",
    'trainer.logger=["console","wandb"]', "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
    "trainer.val_before_train=False", "trainer.save_freq=20", "trainer.test_freq=10", "trainer.total_epochs=15",
    "ray_kwargs.ray_init.runtime_env.py_executable=null",
]
EXAMPLES = {
    "gdpo_trainer": ["algorithm.adv_estimator=gdpo", '+algorithm.gdpo_reward_keys=["accuracy_reward", "format_reward"]',
                     "algorithm.kl_ctrl.kl_coef=0.001", "reward.custom_reward_function.path=/verl/rlla.py",
                     "reward.custom_reward_function.name=compute_score", "reward.reward_manager.name=gdpo"],
    "otb_trainer": ["algorithm.adv_estimator=optimal_token_baseline", "algorithm.use_kl_in_reward=False",
                    "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.actor.calculate_sum_pi_squared=True"],
    "otb_trainer (ADV_ESTIMATOR=tir_optimal_token_baseline)": [
        "algorithm.adv_estimator=tir_optimal_token_baseline", "algorithm.use_kl_in_reward=False",
        "actor_rollout_ref.actor.calculate_sum_pi_squared=True"],
    "sapo_trainer": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=sapo",
                     "+actor_rollout_ref.actor.policy_loss.tau_pos=1.0",
                     "+actor_rollout_ref.actor.policy_loss.tau_neg=1.05", "actor_rollout_ref.actor.strategy=fsdp2",
                     "actor_rollout_ref.ref.strategy=fsdp2"],
    "dppo_trainer (LOSS_MODE=dppo_tv)": ["algorithm.adv_estimator=grpo",
                                         "actor_rollout_ref.actor.policy_loss.loss_mode=dppo_tv",
                                         "actor_rollout_ref.actor.clip_ratio_low=0.15",
                                         "actor_rollout_ref.actor.clip_ratio_high=0.15",
                                         "actor_rollout_ref.actor.clip_ratio_c=10000.0"],
    "dppo_trainer (LOSS_MODE=dppo_kl)": ["algorithm.adv_estimator=grpo",
                                         "actor_rollout_ref.actor.policy_loss.loss_mode=dppo_kl",
                                         "actor_rollout_ref.actor.clip_ratio_low=0.05",
                                         "actor_rollout_ref.actor.clip_ratio_high=0.05"],
    "dro": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=dro",
            "actor_rollout_ref.actor.policy_loss.dro_beta=0.1"],
    "grpo_vectorized": ["algorithm.adv_estimator=grpo_vectorized"],
    "rloo_vectorized": ["algorithm.adv_estimator=rloo_vectorized"],
}


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_verl_example_configs_pass_the_config_check(example):
    config = load_config(None, VERL_SCRIPT + EXAMPLES[example])  # verl's defaults under the script's keys
    if example == "sapo_trainer":  # verl's script writes them under policy_loss; posttrain reads actor.tau_*
        assert (config.actor_rollout_ref.actor.tau_pos, config.actor_rollout_ref.actor.tau_neg) == (1.0, 1.05)
    if example == "gdpo_trainer":
        assert config.algorithm.gdpo_reward_keys == ["accuracy_reward", "format_reward"]


def test_verl_example_configs_are_refused_without_their_keys():
    """Negative controls: each example less the key its algorithm needs is one error naming it."""
    cases = [("gdpo_trainer", '+algorithm.gdpo_reward_keys=["accuracy_reward", "format_reward"]',
              "needs algorithm.gdpo_reward_keys"),
             ("otb_trainer", "actor_rollout_ref.actor.calculate_sum_pi_squared=True",
              "set actor_rollout_ref.actor.calculate_sum_pi_squared=True"),
             ("dro", "actor_rollout_ref.actor.policy_loss.dro_beta=0.1", "needs actor_rollout_ref.actor.policy_loss"
                                                                         ".dro_beta > 0")]
    for example, dropped, message in cases:
        with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("+", r"\+")):
            load_config(None, VERL_SCRIPT + [k for k in EXAMPLES[example] if k != dropped])
    with pytest.raises(ConfigError, match="3 weights for 2"):
        load_config(None, VERL_SCRIPT + EXAMPLES["gdpo_trainer"] + ["+algorithm.gdpo_reward_weights=[1,2,3]"])


# --------------------------------------------------------------------------------- tiny runs


def two_part_score(data_source, solution_str, ground_truth, extra_info=None):
    """A scoring function returning a dict, as verl's GDPO examples' (rlla.py): the score and two parts that
    vary between a tiny random model's responses."""
    accuracy = float(str(ground_truth) in solution_str or len(solution_str) % 2 == 0)
    form = (len(set(solution_str)) % 3) / 2.0
    return {"score": accuracy + form, "accuracy_reward": accuracy, "format_reward": form}


TINY_GDPO = ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[accuracy_reward,format_reward]",
             "algorithm.gdpo_reward_weights=[1.0,0.5]", "trainer.total_training_steps=2",
             "actor_rollout_ref.rollout.n=4"]


DYNAMIC_SAMPLING = ["algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=score",
                    "data.gen_batch_size=4", "algorithm.filter_groups.max_num_gen_batches=10"]


@pytest.mark.parametrize("dynamic_sampling", [False, True])
def test_gdpo_trains_two_steps_on_the_scoring_functions_parts(tmp_path, dynamic_sampling):
    """The parts travel with their rows, also when dynamic sampling drops groups and draws more rounds."""
    with one_thread():
        trainer = tiny_trainer(tmp_path, TINY_GDPO + (DYNAMIC_SAMPLING if dynamic_sampling else []))
        trainer.reward_fn = two_part_score
        history = trainer.fit()
    assert [row["step"] for row in history] == [1, 2]
    if dynamic_sampling:
        assert max(row["train/num_gen_batches"] for row in history) > 1  # some rows were dropped
    for row in history:
        assert math.isfinite(row["actor/pg_loss"]) and all(math.isfinite(v) for v in row.values())
    batch = trainer.last_batch
    parts = {key: batch.non_tensor_batch[key] for key in ("accuracy_reward", "format_reward")}
    # the parts reached the estimator by key, row by row: the advantages are GDPO's of exactly these parts
    assert np.array_equal(parts["accuracy_reward"] + parts["format_reward"],
                          batch["token_level_scores"].sum(-1).double().numpy())
    gdpo = get_adv_estimator_fn("gdpo")
    expected, _ = gdpo(token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
                       index=batch.non_tensor_batch["uid"], config=trainer.config.algorithm, non_tensor_batch=parts)
    torch.testing.assert_close(batch["advantages"], expected)
    # negative control: other weights, or GRPO of the summed score whitened (no config), give other advantages
    swapped = copy.deepcopy(trainer.config.algorithm)
    swapped.gdpo_reward_weights = [0.5, 1.0]
    for config, columns in ((swapped, parts), (None, None)):
        other, _ = gdpo(token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
                        index=batch.non_tensor_batch["uid"], config=config, non_tensor_batch=columns)
        assert not torch.allclose(batch["advantages"], other)


def test_gdpo_names_a_part_the_scoring_function_does_not_return(tmp_path):
    with one_thread():
        trainer = tiny_trainer(tmp_path, TINY_GDPO[:1] + ["algorithm.gdpo_reward_keys=[accuracy_reward,style]"])
        trainer.reward_fn = two_part_score
        with pytest.raises(ValueError, match="gdpo reward key 'style'"):
            trainer.fit()


def test_optimal_token_baseline_trains_two_steps(tmp_path):
    with one_thread():
        trainer = tiny_trainer(tmp_path, ["algorithm.adv_estimator=optimal_token_baseline",
                                          "actor_rollout_ref.actor.calculate_sum_pi_squared=True",
                                          "trainer.total_training_steps=2"])
        assert trainer.sizes.old_log_probs_from == "recompute"  # the pass that sums pi^2 runs
        history = trainer.fit()
    assert [row["step"] for row in history] == [1, 2]
    for row in history:
        assert "timing_s/old_log_prob" in row
        assert math.isfinite(row["actor/pg_loss"]) and all(math.isfinite(v) for v in row.values())
    batch = trainer.last_batch
    mask = batch["response_mask"].bool()
    sum_pi2 = batch["sum_pi_squared"]
    assert bool(((sum_pi2[mask] > 0) & (sum_pi2[mask] <= 1 + 1e-6)).all()) and bool((sum_pi2[~mask] == 0).all())
    # 1 - 2 pi + sum pi^2 = sum over the other words of pi^2 plus (1 - pi)^2 >= 0
    assert bool((1 - 2 * batch["old_log_probs"][mask].exp() + sum_pi2[mask] >= -1e-6).all())
    expected, _ = get_adv_estimator_fn("optimal_token_baseline")(
        token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
        index=batch.non_tensor_batch["uid"], old_log_probs=batch["old_log_probs"], sum_pi_squared=sum_pi2)
    torch.testing.assert_close(batch["advantages"], expected)


@pytest.mark.parametrize("loss", [["sapo", "actor_rollout_ref.actor.tau_pos=2.0"], ["dppo_tv"], ["dppo_kl"],
                                  ["dro", "actor_rollout_ref.actor.policy_loss.dro_beta=0.1"]])
def test_new_policy_losses_train_a_step(tmp_path, loss):
    with one_thread():
        history = tiny_trainer(tmp_path, [f"actor_rollout_ref.actor.policy_loss.loss_mode={loss[0]}",
                                          "actor_rollout_ref.actor.ppo_epochs=2", "trainer.total_training_steps=1",
                                          *loss[1:]]).fit()
    assert math.isfinite(history[0]["actor/pg_loss"]) and math.isfinite(history[0]["actor/grad_norm"])
