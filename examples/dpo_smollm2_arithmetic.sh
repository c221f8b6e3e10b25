#!/usr/bin/env bash
# DPO of SmolLM2-135M-Instruct on preference pairs built from its own samples on the built-in arithmetic
# task, then the held-out greedy accuracy before and after. The whole pipeline, on CPU:
#   1. the built-in task's prompts as a parquet (the RL built-in run's train/test split: same seed, sizes)
#   2. `posttrain prep pairs`: N samples per training prompt, scored by the rule reward; chosen = a
#      correct answer, rejected = a wrong one for the same prompt
#   3. `posttrain dpo` on those pairs, with the greedy held-out accuracy before and after (its own report)
# PAIRS=<file> skips steps 1-2 and uses pairs already written. key=value arguments override dpo keys.
# The timed target (README): held-out flexible accuracy +10 points or more, the `posttrain dpo` line <= 5 min.
set -ex
MODEL=${MODEL:-smollm2-135m-instruct}
OUT=${OUT:-checkpoints/examples/dpo_smollm2_arithmetic}   # this example's own folder
DATA=${DATA:-$OUT/data}
PROMPTS=${PROMPTS:-256}           # training prompts sampled for pairs
SAMPLES=${SAMPLES:-4}             # samples per prompt

if [ -z "${PAIRS:-}" ]; then
    posttrain prep arithmetic --output "$DATA" --digits 2 --ops + --n-train 1024 --n-test 128 --prompt-style fewshot
    time posttrain prep pairs --input "$DATA/train.parquet" --model "$MODEL" --output "$DATA/pairs.parquet" \
        --n "$SAMPLES" --temperature 1.0 --max-new-tokens 48 --reward-key flexible_acc --limit "$PROMPTS" \
        --batch-size 32
    PAIRS="$DATA/pairs.parquet"
fi

# the held-out accuracy before and after: printed by `posttrain dpo` itself; the model: $OUT/hf_model
time posttrain dpo \
    model.partial_pretrain="$MODEL" \
    data.train_files="$PAIRS" \
    data.val_files=null \
    data.train_batch_size=16 \
    data.micro_batch_size_per_gpu=16 \
    data.max_length=512 \
    dpo.beta=0.1 \
    dpo.loss_type=sigmoid \
    optim.lr=1e-6 \
    optim.lr_warmup_steps_ratio=0.05 \
    model.enable_gradient_checkpointing=False \
    model.fsdp_config.mixed_precision.param_dtype=auto \
    use_prefix_grouper=True \
    trainer.total_epochs=1 \
    trainer.n_gpus_per_node=1 \
    trainer.logger=[console,file] \
    trainer.project_name=posttrain \
    trainer.experiment_name=arithmetic_dpo_smollm2 \
    trainer.default_local_dir="$OUT" \
    "$@"
