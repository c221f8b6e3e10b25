#!/usr/bin/env bash
# DPO of SmolLM2-135M-Instruct on preference pairs built from its own samples on the built-in arithmetic
# task (chosen = a correct answer, rejected = a wrong one for the same prompt), then the held-out greedy
# accuracy before and after. Build the pairs first with `posttrain prep pairs` (see `posttrain prep pairs
# --help`) and point PAIRS at its output folder (train.* and, optionally, test.* files of prompt/chosen/
# rejected rows). key=value arguments override.
# The timed target (README): held-out flexible accuracy +10 points or more, the `posttrain dpo` line <= 5 min.
set -ex
PAIRS=${PAIRS:?set PAIRS to the folder written by posttrain prep pairs}
MODEL=${MODEL:-smollm2-135m-instruct}
OUT=${OUT:-checkpoints/posttrain/arithmetic_dpo_smollm2}
TRAIN=$(ls "$PAIRS"/train.* | head -1)

posttrain eval --model "$MODEL" --batch-size 64                   # before
time posttrain dpo \
    model.partial_pretrain="$MODEL" \
    data.train_files="$TRAIN" \
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
    trainer.save_freq=1000 \
    trainer.default_local_dir="$OUT" \
    "$@"
posttrain eval --model "$OUT/hf_model" --batch-size 64                         # after
