#!/usr/bin/env bash
# GRPO on the built-in task (2-digit addition, SmolLM2-135M-Instruct) with no rule reward: the score is a judge
# model's alone (examples/judge_reward.py, a GenRM function as verl's docs write one), the judge served by the
# run itself with posttrain serve (reward.reward_model.*). Held-out accuracy is then measured by the rule.
#
#   1. the judge: the built-in SFT run's model (posttrain sft: ~89% on the held-out sums); skipped when $JUDGE exists
#   2. its agreement with the rule on the policy's held-out answers, beside the untrained model as a judge, each
#      asked both ways (examples/judge_agreement.py: 256 answers; ~8 min on 2 busy cores)
#   3. GRPO on the judge's score alone (the built-in run's other settings); validation reports the judge's score
#   4. the trained model's held-out accuracy by the rule (posttrain eval; the untrained model's is beside it)
#
# JUDGE=path/or/name picks another judge (e.g. JUDGE=smollm2-135m-instruct, the untrained model: it agrees with
# the rule far less), JUDGE_STYLE=verdict asks it "correct? yes or no" instead of solving the question itself.
# key=value arguments go to the GRPO run. Everything is written under $OUT.
set -ex
OUT=${OUT:-checkpoints/examples/judge_reward}
JUDGE=${JUDGE:-$OUT/sft/hf_model}
export JUDGE_STYLE=${JUDGE_STYLE:-solve}
HERE=$(cd "$(dirname "$0")" && pwd)
if [ ! -e "$JUDGE" ] && [ "$JUDGE" = "$OUT/sft/hf_model" ]; then
    time posttrain sft trainer.default_local_dir="$OUT/sft" trainer.experiment_name=judge_sft_smollm2
fi
time python "$HERE/judge_agreement.py" --judge "$JUDGE" --judge smollm2-135m-instruct --styles solve,verdict --n 2 \
    --json "$OUT/agreement.json"
time posttrain train reward.custom_reward_function.path="$HERE/judge_reward.py" \
    reward.reward_model.enable=True reward.reward_model.model_path="$JUDGE" \
    reward.reward_model.rollout.response_length=24 \
    trainer.experiment_name=arithmetic_grpo_judge_smollm2 trainer.default_local_dir="$OUT/grpo" "$@"
time posttrain eval --model "$OUT/grpo/hf_model"
time posttrain eval --model smollm2-135m-instruct
