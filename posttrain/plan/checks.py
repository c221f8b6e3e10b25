"""Checks `plan` adds to the config's own validation: ones that need the flow or the model's shape."""

from __future__ import annotations

from typing import Optional

from posttrain.config.derived import uses_reference
from posttrain.config.schema import PostTrainConfig
from posttrain.plan.flow import Flow
from posttrain.plan.model_dims import ModelDims


def plan_problems(config: PostTrainConfig, flow: Flow, dims: Optional[ModelDims]) -> tuple[list[str], list[str]]:
    """(errors, warnings) beyond `find_problems`."""
    errors: list[str] = []
    warnings: list[str] = []
    arr = config.actor_rollout_ref
    rollout, actor = arr.rollout, arr.actor
    tp_key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    if rollout.name != "hf":
        tp = rollout.tensor_model_parallel_size
        if tp < 1 or tp > flow.world_size or flow.world_size % tp:
            errors.append(f"{tp_key}={tp} must divide the {flow.world_size} GPUs "
                          f"(trainer.nnodes x trainer.n_gpus_per_node) into whole rollout workers")
        elif dims is not None and dims.heads is not None and dims.heads % tp:
            errors.append(f"{tp_key}={tp} does not divide the model's {dims.heads} attention heads; "
                          "the inference engine shards heads across tensor-parallel ranks")
    if actor.use_kl_loss and actor.kl_loss_coef == 0:
        warnings.append("actor_rollout_ref.actor.use_kl_loss=True with kl_loss_coef=0: the reference model is loaded "
                        "and run for a term that weighs nothing")
    if not uses_reference(config) and arr.ref.log_prob_micro_batch_size_per_gpu is not None:
        warnings.append("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu is set but no reference model is used "
                        "(actor.use_kl_loss=False and algorithm.use_kl_in_reward=False)")
    if dims is not None and dims.max_positions and flow.prompt_length + flow.response_length > dims.max_positions:
        warnings.append(f"data.max_prompt_length + data.max_response_length = {flow.prompt_length + flow.response_length} "
                        f"tokens exceeds the model's max_position_embeddings={dims.max_positions}")
    if flow.steps_per_epoch == 0:
        errors.append(f"data.train_batch_size={flow.prompts_per_step} is larger than the {flow.dataset_size} training "
                      "prompts: an epoch has no full batch (the last partial batch is dropped)")
    return errors, warnings
