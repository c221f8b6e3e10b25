#!/usr/bin/env bash
# verl's SFT example (examples/sft/gsm8k/run_qwen_05_peft.sh) with `verl` replaced by `posttrain`, LoRA
# adapters on SmolLM2-135M-Instruct, one process on CPU: GSM8K questions -> worked solutions ending in
# "#### <answer>", read from verl's extra_info layout (what `posttrain prep gsm8k` writes).
# Several ranks: add trainer.n_gpus_per_node=N (Ray). key=value arguments override.
set -ex
DATA=${DATA:-data/gsm8k}
[ -f "$DATA/train.parquet" ] || posttrain prep gsm8k --input "${GSM8K_RAW:-../shared/data/gsm8k}" --output "$DATA"

python -m posttrain.trainer.fsdp_sft_trainer \
    data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" \
    data.prompt_key=extra_info \
    data.response_key=extra_info \
    optim.lr=1e-4 \
    data.prompt_dict_keys=['question'] \
    +data.response_dict_keys=['answer'] \
    data.micro_batch_size_per_gpu=4 \
    data.train_batch_size=32 \
    data.max_length=512 \
    data.truncation=right \
    model.partial_pretrain=smollm2-135m-instruct \
    trainer.default_local_dir=checkpoints/examples/sft_gsm8k \
    trainer.project_name=gsm8k-sft \
    trainer.experiment_name=gsm8k-sft-smollm2-lora \
    trainer.logger=[console,file] \
    trainer.total_epochs=1 \
    trainer.test_freq=50 \
    trainer.save_freq=50 \
    trainer.n_gpus_per_node=1 \
    model.lora_rank=32 \
    model.lora_alpha=16 \
    model.target_modules=all-linear \
    model.enable_gradient_checkpointing=False \
    "$@"
