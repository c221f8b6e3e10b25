#!/usr/bin/env bash
# PPO with a critic vs GRPO on the built-in task (2-digit addition, SmolLM2-135M-Instruct), 3 seeds each,
# with `posttrain compare`: the same prompts in the same order and the same sampling seeds for both.
#   A (grpo): the built-in run, GRPO with 4 responses per prompt, 8 prompts a step.
#   B (ppo):  GAE with a learned critic, 1 response per prompt, 32 prompts a step: the same 32 training
#             samples a step and 480 in all (15 steps); the critic's keys as verl's PPO script sets them
#             (builtin.yaml's critic section: the actor's model with a value head, lr 1e-5), no KL loss
#             and no in-reward KL (so no reference model), critic_warmup 0.
# Both update the actor once a step on the whole batch. Runs land in outputs/compare/ppo_vs_grpo/
# (one folder per config and seed, report.md, summary.json, compare.png); the same command again skips
# finished runs and resumes interrupted ones from their checkpoints. Extra key=value arguments apply to both.
set -euo pipefail

PPO="algorithm.adv_estimator=gae actor_rollout_ref.rollout.n=1 data.train_batch_size=32 \
actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.actor.use_kl_loss=False \
algorithm.use_kl_in_reward=False trainer.critic_warmup=0"

posttrain compare builtin "$PPO" --names grpo,ppo --seeds "${SEEDS:-3}" \
    --out "${OUT:-outputs/compare/ppo_vs_grpo}" "$@"
