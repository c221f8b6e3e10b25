#!/usr/bin/env bash
# SFT of SmolLM2-135M-Instruct on the built-in arithmetic task's worked answers ("12 + 34 = 46\n#### 46"),
# on CPU: the built-in SFT run (posttrain/config/sft_builtin.yaml: 40 steps of 16 rows, lr 1e-5, the RL
# built-in run's prompts and train/test split), with the held-out greedy accuracy before and after.
# key=value arguments after the script's name override the SFT run's keys.
# The timed target (README): held-out flexible accuracy +15 points or more, the `posttrain sft` line <= 5 min:
#   /usr/bin/time -v bash examples/sft_smollm2_arithmetic.sh
set -ex
MODEL=${MODEL:-smollm2-135m-instruct}
OUT=${OUT:-checkpoints/examples/sft_smollm2_arithmetic}   # this example's own folder

# the last step saves and exports $OUT/hf_model; the held-out accuracy (the RL run's test split, greedy)
# before and after is the command's own last line but one
time posttrain sft model.partial_pretrain="$MODEL" trainer.default_local_dir="$OUT" "$@"
