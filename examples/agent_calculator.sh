#!/usr/bin/env bash
# An agent written as a plain OpenAI client loop (examples/agent_calculator.py) trained with GRPO through
# the run's endpoint, against the same task on posttrain's own multi-turn loop: the built-in tool task
# (3-digit multiplications) with the calculator, one cold start (multi-turn SFT on calculator traces),
# then the same GRPO stage twice, the same keys, steps and seed: once with multi_turn.enable (the tool
# runs in posttrain), once with agent.episode (the tool runs in the agent). Both trained models are
# measured the same way (benchmarks/tool_use_eval.py: greedy multi-turn rollouts on the held-out rows).
#
#   bash examples/agent_calculator.sh                              # SmolLM2-135M-Instruct, 2 CPU cores
#   SFT_STEPS=4 GRPO_STEPS=10 N_EVAL=64 bash examples/agent_calculator.sh
#
# Measured (SmolLM2-135M-Instruct fp32, 64 held-out rows, greedy; AMD EPYC, 2 shared cores, load 4-9):
#   cold start 90.6% accuracy (100% tool calls); GRPO 10 steps on the multi-turn loop 100%, through the
#   openai agent 100%, agent/retokenized_tokens 0 at every step.
# key=value arguments after the script's name override both GRPO runs' keys. Each stage's wall time and
# the load average go to $OUT/timings.txt, the evaluations to $OUT/tool_use.jsonl, each run's metrics
# (agent/retokenized_tokens among them) to its folder's metrics.jsonl.
set -ex
MODEL=${MODEL:-smollm2-135m-instruct}
OUT=${OUT:-checkpoints/examples/agent_calculator}
DATA=$OUT/data
TOOLS=examples/tool_config/calculator_tool_config.yaml
SFT_STEPS=${SFT_STEPS:-4}
GRPO_STEPS=${GRPO_STEPS:-10}
N_EVAL=${N_EVAL:-64}
mkdir -p "$OUT"
source "$(dirname "$0")/lib/stages.sh"  # stage NAME CMD... (timed, with the load), evaluate STAGE MODEL
grpo() {  # grpo NAME KEY=VALUE...: the GRPO stage of examples/tool_sft_then_grpo.sh from the cold start
    stage "RL $1" posttrain train --config examples/tool_arithmetic_grpo.yaml \
        data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
        actor_rollout_ref.model.path="$OUT/sft/hf_model" \
        trainer.total_training_steps="$GRPO_STEPS" trainer.save_freq="$GRPO_STEPS" \
        trainer.default_local_dir="$OUT/$1" trainer.run_dir="$OUT/$1/run" "${@:2}"
}

stage prep posttrain prep tool-arithmetic --output "$DATA" --tools calculator --trace-tool calculator \
    --n-train 512 --n-test 64
stage "cold start (posttrain sft)" posttrain sft model.partial_pretrain="$MODEL" \
    data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
    data.multiturn.enable=true data.multiturn.messages_key=messages data.multiturn.tools_key=tools \
    data.train_batch_size=8 data.micro_batch_size_per_gpu=8 optim.lr=1e-4 \
    trainer.total_training_steps="$SFT_STEPS" trainer.test_freq=-1 trainer.save_freq=1000 \
    trainer.default_local_dir="$OUT/sft" trainer.experiment_name=agent_calculator_sft
evaluate "cold start" "$OUT/sft/hf_model"
grpo native actor_rollout_ref.rollout.multi_turn.tool_config_path="$TOOLS" "$@"
evaluate "RL native loop" "$OUT/native/hf_model"
grpo agent actor_rollout_ref.rollout.multi_turn.enable=False data.return_raw_chat=True \
    actor_rollout_ref.rollout.agent.episode.path=examples/agent_calculator.py "$@"
evaluate "RL openai agent" "$OUT/agent/hf_model"
grep -h '"agent/retokenized_tokens"' "$OUT/agent/run/metrics.jsonl" | python -c \
    "import json,sys; print('agent/retokenized_tokens per step:', [json.loads(l)['agent/retokenized_tokens'] for l in sys.stdin])" || true
cat "$OUT/timings.txt" "$OUT/tool_use.jsonl"
