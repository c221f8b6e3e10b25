"""The SFT / DPO tree on the RL workers: its roles and what the RL driver reads (`sft_role_specs`).

The actor is the trained model: its model section is ``model.*``, its optimizer and schedule
``optim.*``, its micro-batch ``data.micro_batch_size_per_gpu``; DPO without precomputed log-probs adds
a reference (a frozen copy, or the actor with its adapters disabled under LoRA). Every other key of
the RL sections keeps its RL default, so an RL actor key reaches SFT with no edit here. No critic and
no reward model: the SFT tree never asks for them. Batch sizes are per rank.
"""

from __future__ import annotations

from posttrain.config.actor_rollout_ref import ActorRolloutRefConfig
from posttrain.config.roles import RoleSpecs, specs_from_actor_rollout_ref
from posttrain.config.schema import PostTrainConfig, TrainerConfig
from posttrain.config.sft import SFTConfig

__all__ = ["sft_actor_rollout_ref", "sft_driver_config", "sft_role_specs"]


def sft_role_specs(config: SFTConfig, total_steps: int, *, reference: bool) -> tuple[RoleSpecs, PostTrainConfig]:
    """The roles (the actor; the reference when ``reference``) and the driver's config (`sft_driver_config`)."""
    arr = sft_actor_rollout_ref(config, total_steps, reference=reference)
    return specs_from_actor_rollout_ref(arr, reference=reference), sft_driver_config(config, arr)


def sft_actor_rollout_ref(config: SFTConfig, total_steps: int, *, reference: bool) -> ActorRolloutRefConfig:
    """RL's ``actor_rollout_ref`` sections with the SFT tree's keys (module docstring)."""
    m, o, d = config.model, config.optim, config.data
    arr = ActorRolloutRefConfig()
    mc = arr.model
    mc.path, mc.trust_remote_code, mc.external_lib = m.partial_pretrain, m.trust_remote_code, m.external_lib
    mc.override_config = dict(m.override_config)
    mc.enable_gradient_checkpointing = m.enable_gradient_checkpointing
    mc.use_remove_padding, mc.custom_chat_template = config.use_remove_padding, d.chat_template
    mc.lora_rank, mc.lora_alpha, mc.target_modules = m.lora_rank, m.lora_alpha, m.target_modules
    mc.exclude_modules, mc.lora_adapter_path = m.exclude_modules, m.lora_adapter_path
    actor = arr.actor
    actor.fsdp_config = m.fsdp_config
    actor.use_remove_padding, actor.use_prefix_grouper = config.use_remove_padding, config.use_prefix_grouper
    actor.ppo_micro_batch_size_per_gpu, actor.ppo_mini_batch_size = d.micro_batch_size_per_gpu, d.train_batch_size
    actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu = d.use_dynamic_bsz, d.max_token_len_per_gpu
    actor.grad_clip, actor.use_kl_loss = o.clip_grad, reference
    ao = actor.optim
    ao.lr, ao.betas, ao.weight_decay = o.lr, list(o.betas), o.weight_decay
    ao.optimizer, ao.optimizer_impl, ao.override_optimizer_config = o.optimizer, o.optimizer_impl, o.override_optimizer_config
    ao.lr_warmup_steps = o.lr_warmup_steps
    ao.lr_warmup_steps_ratio = o.warmup_steps_ratio if o.warmup_steps_ratio is not None else o.lr_warmup_steps_ratio
    ao.lr_scheduler_type, ao.min_lr_ratio, ao.total_training_steps = o.lr_scheduler, o.min_lr_ratio, total_steps
    arr.ref.fsdp_config.mixed_precision.param_dtype = m.fsdp_config.mixed_precision.param_dtype
    arr.ref.fsdp_config.model_dtype = m.fsdp_config.model_dtype
    arr.ref.use_prefix_grouper = config.use_prefix_grouper
    for section in (arr.rollout, arr.ref):
        section.log_prob_micro_batch_size_per_gpu = d.micro_batch_size_per_gpu
        section.log_prob_use_dynamic_bsz, section.log_prob_max_token_len_per_gpu = d.use_dynamic_bsz, d.max_token_len_per_gpu
    arr.rollout.name = "hf"
    return arr


def sft_driver_config(config: SFTConfig, arr: ActorRolloutRefConfig) -> PostTrainConfig:
    """What the RL driver's parts read (device and ranks, the checkpoint folder's rule, resume, Ray's
    placement, the checkpoint's fingerprint): ``trainer.*`` from the SFT tree, the actor's sections,
    no critic (``grpo``), RL's defaults for the rest. The fingerprint reads RL key names, so the
    checkpoints of earlier SFT / DPO runs keep resuming."""
    t = config.trainer
    tr = TrainerConfig()
    tr.nnodes, tr.n_gpus_per_node, tr.device, tr.seed = t.nnodes, t.n_gpus_per_node, t.device, t.seed
    tr.default_local_dir, tr.resume_mode, tr.start_over = t.default_local_dir, t.resume_mode, t.start_over
    tr.resume_from_path = t.resume_from_path or t.resume_path
    if t.resume_path and t.resume_mode == "auto":
        tr.resume_mode = "resume_path"
    tr.save_freq, tr.test_freq, tr.balance_batch = t.save_freq, t.test_freq, False
    tr.max_actor_ckpt_to_keep = t.max_ckpt_to_keep
    tr.project_name, tr.experiment_name, tr.run_dir = t.project_name, t.experiment_name, t.run_dir
    rl = PostTrainConfig(actor_rollout_ref=arr, trainer=tr)
    rl.algorithm.adv_estimator = "grpo"
    return rl
