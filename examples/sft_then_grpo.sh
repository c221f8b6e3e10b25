#!/usr/bin/env bash
# The pipeline SFT -> GRPO on the built-in arithmetic task: the built-in SFT run, its exported model as
# the RL run's actor_rollout_ref.model.path, then the built-in GRPO run. Compare with `posttrain train`
# alone in the same total time (README). SFT_STEPS / GRPO_STEPS split the time between the stages.
# Both stages write under $OUT (this example's own folders); key=value arguments override the GRPO run's keys.
set -ex
OUT=${OUT:-checkpoints/examples/sft_then_grpo}
time posttrain sft trainer.total_training_steps="${SFT_STEPS:-20}" trainer.default_local_dir="$OUT/sft"
time posttrain train actor_rollout_ref.model.path="$OUT/sft/hf_model" trainer.total_training_steps="${GRPO_STEPS:-10}" \
    trainer.experiment_name=arithmetic_sft_grpo_smollm2 trainer.default_local_dir="$OUT/grpo" "$@"
