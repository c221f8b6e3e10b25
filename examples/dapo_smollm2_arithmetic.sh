#!/usr/bin/env bash
# DAPO on the built-in arithmetic task with SmolLM2-135M-Instruct, on CPU: verl's DAPO recipe
# settings (recipe/dapo/run_dapo_qwen2.5_32b.sh) at the built-in run's size, layered over the
# built-in run (`posttrain train`); key=value arguments after the script's name override these.
#   clip-higher        clip_ratio_low 0.2, clip_ratio_high 0.28 (dual-clip bound 10, as verl's recipe)
#   token-level loss   loss_agg_mode=token-mean
#   dynamic sampling   groups whose 4 answers are all right or all wrong (acc) are dropped, and rounds
#                      of 12 prompts are generated until 8 groups with signal remain (at most 10 rounds)
#   overlong shaping   responses longer than 32 - 8 = 24 tokens lose up to 1.0 of their reward
#                      (a worked 2-digit answer such as '89 + 86 = 175\n#### 175' takes ~17)
#   no KL              neither in the reward nor in the loss, so no reference model is loaded
# Explain it first: posttrain plan --config posttrain/config/builtin.yaml examples/dapo_smollm2_arithmetic.sh
set -x

posttrain train \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    algorithm.kl_ctrl.kl_coef=0.0 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.kl_loss_coef=0.0 \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.clip_ratio_c=10.0 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.entropy_coeff=0 \
    data.train_batch_size=8 \
    data.gen_batch_size=12 \
    data.max_response_length=32 \
    algorithm.filter_groups.enable=True \
    algorithm.filter_groups.metric=acc \
    algorithm.filter_groups.max_num_gen_batches=10 \
    reward_model.reward_manager=dapo \
    reward_model.overlong_buffer.enable=True \
    reward_model.overlong_buffer.len=8 \
    reward_model.overlong_buffer.penalty_factor=1.0 \
    reward_model.overlong_buffer.log=True \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.top_p=1.0 \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    trainer.experiment_name=arithmetic_dapo_smollm2 \
    trainer.default_local_dir=checkpoints/examples/dapo_smollm2_arithmetic \
    trainer.total_training_steps=15 "$@"
