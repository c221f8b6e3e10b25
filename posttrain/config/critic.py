"""Config sections `critic.*` (the learned value function of PPO/GAE) and `reward_model.*`."""

from __future__ import annotations

from dataclasses import field
from typing import Any, Optional

from posttrain.config.actor_rollout_ref import (
    CheckpointContentsConfig,
    FSDPConfig,
    OptimConfig,
    RefFSDPConfig,
    _cfg,
)


def _critic_optim() -> OptimConfig:
    return OptimConfig(lr=1e-5)


@_cfg()
class CriticModelConfig:
    path: str = "~/models/deepseek-llm-7b-chat"
    """Critic backbone checkpoint (usually the same as the actor's; a scalar value head is added)."""
    tokenizer_path: str = "${actor_rollout_ref.model.path}"
    """Tokenizer of the critic (follows the actor's model path)."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Entries that override the critic's HF config."""
    external_lib: Optional[str] = "${actor_rollout_ref.model.external_lib}"
    """Module to import before loading."""
    trust_remote_code: bool = "${actor_rollout_ref.model.trust_remote_code}"  # type: ignore[assignment]
    """Allow model code from the checkpoint folder to run."""
    use_shm: bool = False
    """Copy the model to shared memory before loading."""
    enable_gradient_checkpointing: bool = True
    """Recompute activations in backward to save memory."""
    enable_activation_offload: bool = False
    """Offload activations to CPU."""
    use_remove_padding: bool = False
    """Drop padding tokens before the forward pass."""
    compile_layers: bool = "${actor_rollout_ref.model.compile_layers}"  # type: ignore[assignment]
    """(posttrain) The critic's decoder layers through torch.compile in its value and update passes (follows the actor's key)."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP and precision settings of the critic."""
    lora_rank: int = 0
    """LoRA rank (0: full fine-tuning); > 0 trains LoRA adapters on a frozen backbone, with the value head fully trained."""
    lora_alpha: int = 16
    """LoRA alpha: the adapter's update is scaled by lora_alpha / lora_rank."""
    target_modules: Any = "all-linear"
    """Backbone layers given adapters: all-linear, a list of module names, or a regex on full module names."""


@_cfg()
class CriticConfig:
    rollout_n: int = "${actor_rollout_ref.rollout.n}"  # type: ignore[assignment]
    """Follows actor_rollout_ref.rollout.n (mini-batches are multiplied by it)."""
    strategy: str = "fsdp"
    """Training backend."""
    enable: Optional[bool] = None
    """Use a critic; null: exactly when algorithm.adv_estimator=gae."""
    optim: OptimConfig = field(default_factory=_critic_optim)
    """Optimizer and learning-rate schedule of the critic."""
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    """The value model."""
    ppo_mini_batch_size: int = "${actor_rollout_ref.actor.ppo_mini_batch_size}"  # type: ignore[assignment]
    """Prompts per critic mini-batch (follows the actor's)."""
    ppo_micro_batch_size: Optional[int] = None
    """Deprecated global micro-batch size; use ppo_micro_batch_size_per_gpu."""
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    """Responses per critic forward/backward on one rank."""
    use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    """Pack micro-batches by tokens."""
    ppo_max_token_len_per_gpu: int = 32768
    """Token budget per micro-batch when dynamic."""
    forward_max_token_len_per_gpu: int = "${critic.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    """Token budget per value forward pass when dynamic."""
    ppo_epochs: int = "${actor_rollout_ref.actor.ppo_epochs}"  # type: ignore[assignment]
    """Passes over each batch (follows the actor)."""
    shuffle: bool = "${actor_rollout_ref.actor.shuffle}"  # type: ignore[assignment]
    """Shuffle before mini-batching (follows the actor)."""
    use_prefix_grouper: bool = "${actor_rollout_ref.actor.use_prefix_grouper}"  # type: ignore[assignment]
    """(posttrain) Encode each distinct prompt of a micro-batch once, and the beginning its prompts share, in the value and critic-update forwards, as the actor's key of this name does (follows it): the same values and gradients on fewer tokens. Off where critic.model.use_remove_padding packs the rows instead."""
    cliprange_value: float = 0.5
    """Value clip: new values stay within old values +- this."""
    loss_scale_factor: Optional[float] = "${actor_rollout_ref.actor.loss_scale_factor}"  # type: ignore[assignment]
    """Constant divisor of the value loss with loss_agg_mode=seq-mean-token-sum-norm (follows the actor's; null: the response length)."""
    loss_agg_mode: str = "${actor_rollout_ref.actor.loss_agg_mode}"
    """Aggregation of the value loss (follows the actor)."""
    checkpoint: CheckpointContentsConfig = field(default_factory=CheckpointContentsConfig)
    """Checkpoint contents."""
    forward_micro_batch_size: Optional[int] = None
    """Deprecated global forward micro-batch size."""
    forward_micro_batch_size_per_gpu: Optional[int] = None
    """Responses per value forward pass on one rank (null: ppo_micro_batch_size_per_gpu)."""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses sequence-parallel group size."""
    grad_clip: float = 1.0
    """Global gradient-norm clip of the critic."""


@_cfg()
class RewardModelSubConfig:
    input_tokenizer: Optional[str] = "${actor_rollout_ref.model.path}"
    """Tokenizer that decodes the policy's responses (verl: the actor's). Set: each prompt's chat messages plus the decoded response (eos removed) are rendered with the reward model's own chat template and re-tokenized; null: the reward model reads the actor's token ids as they are (same vocabulary needed)."""
    path: str = "~/models/FsfairX-LLaMA3-RM-v0.1"
    """Reward model checkpoint: a ...ForSequenceClassification folder or hub id with one label (num_labels=1); its tokenizer loads from the same path."""
    external_lib: Optional[str] = "${actor_rollout_ref.model.external_lib}"
    """Python module imported before the reward model loads (one that registers its model class)."""
    trust_remote_code: bool = False
    """Allow model code from the checkpoint folder to run."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Entries that override the reward model's HF config."""
    use_shm: bool = False
    """Copy the model to shared memory before loading (accepted; posttrain loads from the path)."""
    use_remove_padding: bool = False
    """Drop padding tokens before the forward pass (accepted; the reward model runs padded, same scores)."""
    use_fused_kernels: bool = False
    """Use fused kernels (accepted; no effect on the reward model)."""
    fsdp_config: RefFSDPConfig = field(default_factory=RefFSDPConfig)
    """FSDP settings of the reward model (the reference's fields: param_offload, model_dtype; mixed_precision.param_dtype bf16 as verl computes it, auto: the actor's)."""


@_cfg()
class SandboxFusionConfig:
    url: Optional[str] = None
    """Sandbox service for code rewards."""
    max_concurrent: int = 64
    """Concurrent sandbox requests."""
    memory_limit_mb: int = 1024
    """Sandbox memory limit."""


@_cfg()
class OverlongBufferConfig:
    enable: bool = False
    """DAPO overlong reward shaping (needs reward_manager=dapo): a response longer than data.max_response_length - len tokens loses up to penalty_factor."""
    len: int = 0
    """Buffer length in tokens at the end of data.max_response_length where the penalty grows linearly from 0 to penalty_factor."""
    penalty_factor: float = 0.0
    """Penalty of a response that fills data.max_response_length."""
    log: bool = False
    """Record each response's penalty (reward/overlong_reward/mean, reward/overlong/mean: the fraction penalised)."""


@_cfg()
class RewardModelConfig:
    enable: bool = False
    """Score responses with a learned reward model (reward_model.model.path). As in verl its score replaces the rule-based or custom reward in training (see combine); validation scores with the rule-based reward and is skipped for rows whose reward_model.style is model."""
    combine: str = "replace"
    """(posttrain) How the reward model's score meets the rule-based reward: replace (verl: the reward model's score is the reward, the reward function is not called) or sum (rule-based score + reward-model score)."""
    strategy: str = "fsdp"
    """Backend of the reward model."""
    model: RewardModelSubConfig = field(default_factory=RewardModelSubConfig)
    """The reward model."""
    micro_batch_size: Optional[int] = None
    """Deprecated global micro-batch size (divided by the ranks); use micro_batch_size_per_gpu."""
    micro_batch_size_per_gpu: Optional[int] = None
    """Responses per reward-model forward pass on one rank (needed unless use_dynamic_bsz)."""
    max_length: Optional[int] = None
    """Longest re-templated input in tokens; a longer one is cut from the right, as in verl (null: the actor's prompt + response width)."""
    use_dynamic_bsz: bool = "${critic.use_dynamic_bsz}"  # type: ignore[assignment]
    """Pack reward-model passes by tokens."""
    forward_max_token_len_per_gpu: int = "${critic.forward_max_token_len_per_gpu}"  # type: ignore[assignment]
    """Token budget per pass when dynamic."""
    reward_manager: str = "naive"
    """Reward manager: naive (one score per response), or dapo (also records a plain-number score as acc, and applies overlong_buffer)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO overlong reward shaping (verl's DAPO recipe keys)."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the reward manager, verl's main_ppo form of the overlong buffer: +reward_model.reward_kwargs.overlong_buffer_cfg.{enable,len,penalty_factor,log} and +reward_model.reward_kwargs.max_resp_len (use this or overlong_buffer)."""
    launch_reward_fn_async: bool = False
    """Score in the background while the actor computes log-probs."""
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    """Code-execution sandbox."""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses sequence-parallel group size."""
