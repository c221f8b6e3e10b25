"""Checks `plan` adds to the config's own validation: ones that need the flow or the model's shape."""

from __future__ import annotations

from typing import Any, Collection, Optional

from posttrain.config.derived import uses_reference
from posttrain.config.schema import PostTrainConfig
from posttrain.plan.flow import Flow
from posttrain.plan.model_dims import ModelDims


def plan_problems(config: PostTrainConfig, flow: Flow, dims: Optional[ModelDims],
                  set_keys: Optional[Collection[str]] = None) -> tuple[list[str], list[str]]:
    """(errors, warnings) beyond `find_problems`; ``set_keys``: the keys the user set (None: judged by value)."""
    errors: list[str] = []
    warnings: list[str] = []
    arr = config.actor_rollout_ref
    rollout, actor = arr.rollout, arr.actor
    if rollout.name == "sglang":
        # `posttrain train` refuses it at start-up (posttrain.rollout.engines.SGLANG_MISSING); not imported
        # here because that module loads torch and `plan` stays light.
        errors.append("actor_rollout_ref.rollout.name=sglang: posttrain has no SGLang engine and `posttrain train` "
                      "refuses it at start-up; use actor_rollout_ref.rollout.name=vllm or hf")
    # tensor_model_parallel_size is read and not applied (plan.flow.ENGINE_TENSOR_PARALLEL), so a size that would
    # not divide the GPUs or heads breaks nothing here; the flow's note says so instead of an error.
    ref_key = "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"
    ref_key_set = ref_key in set_keys if set_keys is not None else arr.ref.log_prob_micro_batch_size_per_gpu is not None
    if not uses_reference(config) and ref_key_set:
        warnings.append("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu is set but no reference model is used "
                        "(no KL loss, or its kl_loss_coef is 0, and algorithm.use_kl_in_reward=False)")
    if dims is not None and dims.max_positions and flow.prompt_length + flow.response_length > dims.max_positions:
        warnings.append(f"data.max_prompt_length + data.max_response_length = {flow.prompt_length + flow.response_length} "
                        f"tokens exceeds the model's max_position_embeddings={dims.max_positions}")
    if flow.steps_per_epoch == 0:
        errors.append(f"data.train_batch_size={flow.prompts_per_step} is larger than the {flow.dataset_size} training "
                      "prompts: an epoch has no full batch (the last partial batch is dropped)")
    return errors, warnings


def model_path_problems(config: PostTrainConfig, models: list[dict[str, Any]]) -> list[str]:
    """Each model the run loads (``models``: `posttrain.plan.flow.uses_models`) whose path names nothing here
    (`posttrain train` refuses these before loading anything), so a missing folder is an error of the plan,
    not only a shape it could not read."""
    from posttrain.trainer.preflight import check_model_paths, model_path_problem

    problems = check_model_paths(config)  # the actor, data.tokenizer, the critic, a judge the run serves
    more = [("reward_model.model.path", config.reward_model.model.path)] if config.reward_model.enable else []
    more += [(f"the {m['role']}'s model_path (distillation.teacher_models)", m["model"]) for m in models
             if m["role"].startswith("teacher") and m["model"] is not None]
    for key, path in more:
        problem = model_path_problem(path)
        if problem is not None:
            problems.append(f"{key}={path}: {problem}")
    return problems
