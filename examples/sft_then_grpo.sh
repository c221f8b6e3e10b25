#!/usr/bin/env bash
# The pipeline SFT -> GRPO on the built-in arithmetic task: the built-in SFT run, its exported model as
# the RL run's actor_rollout_ref.model.path, then the built-in GRPO run. Compare with `posttrain train`
# alone in the same total time (README). SFT_STEPS / GRPO_STEPS split the time between the stages.
set -ex
SFT_OUT=${SFT_OUT:-checkpoints/posttrain/arithmetic_sft_smollm2}
time posttrain sft trainer.total_training_steps="${SFT_STEPS:-20}" trainer.save_freq=1000 \
    trainer.default_local_dir="$SFT_OUT"
time posttrain train actor_rollout_ref.model.path="$SFT_OUT/hf_model" trainer.total_training_steps="${GRPO_STEPS:-10}" \
    trainer.experiment_name=arithmetic_sft_grpo_smollm2 "$@"
