#!/usr/bin/env bash
# SFT -> on-policy distillation (OPD) on the built-in task (2-digit addition):
#   1. the teacher: the built-in SFT run (`posttrain sft`, SmolLM2-135M-Instruct fine-tuned on worked answers),
#      exported as $OUT/teacher/hf_model (skipped when it is already there);
#   2. the student: SmolLM2-135M-Instruct itself, trained by the built-in RL run (GRPO's rollouts and task
#      rewards, 8 prompts x 4 samples a step, 15 steps) with verl's distillation.* keys: the teacher scores
#      every token the student samples, its top-32 tokens at each position (forward_kl_topk, back-propagated,
#      GKD-style), beside the task rewards' GRPO loss; no KL term to the initial model (the teacher is the
#      anchor), so no reference model is loaded.
# With COMPARE=1 the same OPD run is then compared with GRPO over $SEEDS seeds (`posttrain compare`: the same
# prompts, the same sampling seeds, the same 480 training samples each), in outputs/compare/opd_vs_grpo/.
# Both stages write under $OUT; key=value arguments override the OPD run's keys (and, with COMPARE=1, both sides').
set -euo pipefail
OUT=${OUT:-checkpoints/examples/sft_then_opd}
TEACHER="$OUT/teacher/hf_model"
if [ ! -f "$TEACHER/config.json" ]; then
    time posttrain sft trainer.total_training_steps="${SFT_STEPS:-40}" trainer.default_local_dir="$OUT/teacher"
fi
OPD="distillation.enabled=true distillation.teacher_models.teacher_model.model_path=$TEACHER \
distillation.distillation_loss.loss_mode=forward_kl_topk distillation.distillation_loss.topk=32 \
actor_rollout_ref.actor.use_kl_loss=false"
if [ "${COMPARE:-0}" = 1 ]; then
    posttrain compare builtin "$OPD" --names grpo,opd --seeds "${SEEDS:-3}" \
        --out "${COMPARE_OUT:-outputs/compare/opd_vs_grpo}" "$@"
else
    # shellcheck disable=SC2086 # $OPD is a list of key=value words
    time posttrain train $OPD trainer.experiment_name=arithmetic_opd_smollm2 trainer.default_local_dir="$OUT/opd" "$@"
fi
