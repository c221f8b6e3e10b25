"""Config sections under `actor_rollout_ref.*`: the policy model, its optimizer, the rollout
engine and the frozen reference policy.

Key names and defaults are verl 0.9's (`verl/trainer/config/ppo_trainer.yaml`). Keys marked
"(posttrain)" are ours. A default of the form `${...}` follows another key, as in verl.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


def _cfg(**kwargs):
    """Dataclass decorator for config nodes: keyword-only, and slots so a typo'd attribute fails."""
    return dataclass(kw_only=True, slots=True, **kwargs)


@_cfg()
class MixedPrecisionConfig:
    param_dtype: str = "bf16"
    """Compute dtype for forward/backward: bf16 (autocast; AMX on CPU, tensor cores on GPU), fp32, or auto
    (posttrain: bf16 on CUDA; on CPU the faster of the two for this model, measured once and cached)."""
    reduce_dtype: str = "fp32"
    """Dtype of gradient reduction across ranks."""
    buffer_dtype: str = "fp32"
    """Dtype of model buffers."""


@_cfg()
class WrapPolicyConfig:
    min_num_params: int = 0
    """FSDP auto-wrap threshold in parameters (0: wrap by transformer layer)."""


HOST_MEMORY_MODES = ("auto", "balanced", "speed", "memory")
"""``fsdp_config.host_memory``'s values."""
HOST_PAGING_MODES = ("auto", "on", "off")
"""``fsdp_config.host_paging``'s values."""


@_cfg()
class FSDPConfig:
    wrap_policy: WrapPolicyConfig = field(default_factory=WrapPolicyConfig)
    """FSDP wrapping policy."""
    param_offload: bool = False
    """Keep parameters in CPU memory between uses (saves GPU memory, costs transfers). On a one-process CPU run the actor's weights are in use in every phase: no effect."""
    optimizer_offload: bool = False
    """Keep optimizer state in CPU memory. On a one-process CPU run: AdamW's moments paged to a file in TMPDIR (on a disk) between optimizer steps, one parameter's in memory at a time; the actor also returns its rollout's and update's large buffers to the kernel when freed: memory over speed (posttrain.host.paging; docs/guide.md: Memory on a CPU)."""
    offload_policy: bool = False
    """FSDP2 CPUOffloadPolicy for parameters, gradients and optimizer state."""
    host_paging: str = "auto"
    """(posttrain) Whether a one-process CPU run pages this role's idle state to a file in TMPDIR: a frozen role's weights between its passes, a trained role's 8-bit AdamW moments between optimizer steps; the same numbers. auto: where TMPDIR is on a disk and the file can be reserved (else in memory, said in the memory plan line); on: always (a tmpfs is an error); off: only where param_offload / optimizer_offload ask (docs/guide.md: Memory on a CPU)."""
    host_memory: str = "auto"
    """(posttrain; the actor's: one policy for the whole process, which a critic's may only repeat) What a one-process CPU run does with freed memory: balanced (large blocks and the heap's free pages handed back between phases), speed (every freed block kept for reuse: the peak grows from step to step), memory (the actor's rollout and update buffers mapped and handed back: the lowest peak, slower steps); auto: balanced (docs/guide.md: Memory on a CPU)."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (FSDP2)."""
    fsdp_size: int = -1
    """Ranks per FSDP group (-1: all ranks)."""
    forward_prefetch: bool = False
    """Prefetch the next all-gather during forward."""
    model_dtype: str = "fp32"
    """Dtype of the master weights the optimizer updates (fp32 recommended)."""
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    """Compute precision."""


@_cfg()
class OptimConfig:
    lr: float = 1e-6
    """Learning rate."""
    lr_warmup_steps_ratio: float = 0.0
    """Warm-up steps as a fraction of total training steps (used when lr_warmup_steps < 0)."""
    total_training_steps: int = -1
    """Total optimizer schedule length; -1: filled in by the trainer."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    lr_warmup_steps: int = -1
    """Warm-up steps; -1: use lr_warmup_steps_ratio."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    clip_grad: float = 1.0
    """Unused alias kept for verl compatibility; the clip used is the role's grad_clip."""
    min_lr_ratio: float = 0.0
    """Cosine schedule floor as a fraction of lr."""
    num_cycles: float = 0.5
    """Cosine cycles over the schedule (0.5: one half-cosine down)."""
    lr_scheduler_type: str = "constant"
    """Schedule after warm-up: constant or cosine."""
    warmup_style: Optional[str] = None
    """Deprecated verl name of lr_scheduler_type; when set it wins."""
    optimizer: str = "auto"
    """AdamW (float32 moments; also adamw_torch), posttrain_adamw_8bit (posttrain's 8-bit block-wise moments, 2 bytes
    a parameter instead of 8, updated in C), a library's optimizer by transformers' name (adamw_8bit and adamw_bnb_8bit:
    bitsandbytes; adamw_torch_8bit: torchao), or auto: the run's memory plan chooses (posttrain_adamw_8bit on a
    one-process CPU run); with optimizer_impl another module, the name of its class (verl: AdamW8bit with torchao.optim)."""
    optimizer_impl: str = "torch.optim"
    """Module the optimizer class comes from (verl's key): torch.optim (AdamW and posttrain's own names above, or any torch.optim class such as SGD), posttrain.optim (the same names), or any importable module, e.g. torchao.optim or bitsandbytes.optim, whose class `optimizer` is built with lr, betas, weight_decay."""
    override_optimizer_config: Optional[dict[str, Any]] = None
    """Extra constructor arguments of the optimizer (verl's key), e.g. {eps: 1e-6}; null: none."""


@_cfg()
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    """Policy loss (posttrain.algorithms): vanilla (PPO clip), gspo, sapo, gpg, clip_cov, kl_cov, geo_mean, cispo, dppo_tv, dppo_kl, dro."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of tokens whose gradient is clipped."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the covariance window."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of the covariance window."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of tokens given the KL penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: coefficient of that KL penalty."""
    dro_beta: Optional[float] = None
    """dro: weight (> 0) of the quadratic log-ratio penalty of Direct Reward Optimization; required when loss_mode=dro."""


@_cfg()
class CheckpointContentsConfig:
    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """What a checkpoint holds."""
    load_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """What resume loads."""
    async_save: bool = False
    """Save in the background (not supported yet; must stay false)."""


@_cfg()
class ActorConfig:
    strategy: str = "fsdp"
    """Training backend: fsdp or fsdp2."""
    ppo_mini_batch_size: int = 256
    """Prompts per PPO mini-batch (one optimizer step); multiplied by rollout.n and split across ranks."""
    ppo_micro_batch_size: Optional[int] = None
    """Deprecated global micro-batch size; use ppo_micro_batch_size_per_gpu."""
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    """Responses per forward/backward pass on one rank (gradient accumulation splits the mini-batch)."""
    use_dynamic_bsz: bool = False
    """Pack micro-batches by token count (ppo_max_token_len_per_gpu) instead of rows; with use_prefix_grouper,
    whole prompts (each counted once, its responses as long as the micro-batch's longest)."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget per micro-batch when use_dynamic_bsz (bounds the update's activation memory)."""
    clip_ratio: float = 0.2
    """PPO clip epsilon (default for clip_ratio_low and clip_ratio_high)."""
    clip_ratio_low: float = 0.2
    """Lower clip epsilon: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """Upper clip epsilon: ratio <= 1 + clip_ratio_high (DAPO raises it)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Policy-loss variant and its knobs."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant for negative advantages (must be > 1)."""
    tau_pos: float = 1.0
    """SAPO's gate temperature where the advantage is positive (policy_loss.loss_mode=sapo)."""
    tau_neg: float = 1.05
    """SAPO's gate temperature where the advantage is zero or negative (> tau_pos: asymmetric)."""
    calculate_sum_pi_squared: bool = False
    """Also compute each token's sum over the vocabulary of pi^2 in the old-log-prob pass (needed by algorithm.adv_estimator=optimal_token_baseline and tir_optimal_token_baseline)."""
    loss_scale_factor: Optional[float] = None
    """Constant divisor of loss_agg_mode=seq-mean-token-sum-norm (null: the response length, Dr.GRPO's choice)."""
    loss_agg_mode: str = "token-mean"
    """How token losses become one number: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus in the actor loss."""
    use_kl_loss: bool = False
    """Add a KL(actor || reference) term to the actor loss (GRPO style); loads the reference model."""
    use_torch_compile: bool = True
    """verl's switch for compiling its entropy kernel; accepted and unused here (log-probs and entropy use torch's fused log_softmax; compiling them saved under 1% of a step for seconds of compilation per process: benchmarks/README.md). Decoder layers compile with actor_rollout_ref.model.compile_layers."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator for the loss: kl/k1, abs, mse/k2, low_var_kl/k3, full."""
    ppo_epochs: int = 1
    """Passes over each training batch."""
    shuffle: bool = False
    """Shuffle responses before splitting into mini-batches."""
    checkpoint: CheckpointContentsConfig = field(default_factory=CheckpointContentsConfig)
    """Checkpoint contents."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses sequence-parallel group size."""
    entropy_from_logits_with_chunking: bool = False
    """Compute entropy in chunks (posttrain always chunks; accepted for compatibility)."""
    entropy_checkpointing: bool = False
    """Recompute entropy in backward to save memory."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP and precision settings."""
    use_remove_padding: bool = "${actor_rollout_ref.model.use_remove_padding}"  # type: ignore[assignment]
    """Follows actor_rollout_ref.model.use_remove_padding."""
    use_prefix_grouper: bool = False
    """Encode each distinct prompt of a micro-batch once for all its responses (n > 1), in the old-log-prob, reference and update forwards: the same log-probs and gradients on fewer tokens (responses packed without their padding). On CPU with sdpa attention the micro-batch becomes one row, the beginning its prompts share (a system prompt, a worked example) encoded once too, also with n = 1, and attention runs by blocks (the beginning; each prompt's own tokens against it and themselves; each response against its prompt and itself); other kernels get one row per prompt and a dense mask. Rows of one prompt share a micro-batch; a micro-batch where this would cost more than it saves (a dense mask with long responses, nothing shared) runs the plain forward. Not with use_remove_padding."""


@_cfg()
class RefFSDPConfig:
    wrap_policy: WrapPolicyConfig = field(default_factory=WrapPolicyConfig)
    """FSDP wrapping policy."""
    param_offload: bool = False
    """Keep reference parameters in CPU memory between uses. On a one-process CPU run: paged to a file in TMPDIR (on a disk) after each pass of the model (reference or reward model; posttrain.host.paging)."""
    host_paging: str = "auto"
    """(posttrain) Whether a one-process CPU run pages the frozen weights to a file in TMPDIR between passes when param_offload is False: auto: on when TMPDIR is on a disk and the file can be reserved there, else in memory (said in the memory plan line); on: on (a tmpfs is an error); off: never. Same numbers; the pages stay in the kernel's page cache while memory is free (posttrain.host.paging; docs/guide.md: Memory on a CPU)."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward."""
    forward_prefetch: bool = False
    """Prefetch the next all-gather during forward."""
    model_dtype: str = "fp32"
    """Dtype the reference weights are kept in."""
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    """Compute precision."""


@_cfg()
class RefConfig:
    strategy: str = "${actor_rollout_ref.actor.strategy}"
    """Backend of the reference model (follows the actor)."""
    use_torch_compile: bool = "${actor_rollout_ref.actor.use_torch_compile}"  # type: ignore[assignment]
    """Follows the actor."""
    log_prob_micro_batch_size: Optional[int] = None
    """Deprecated global micro-batch size; use log_prob_micro_batch_size_per_gpu."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    """Responses per reference forward pass on one rank."""
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    """Pack reference forward passes by tokens."""
    log_prob_max_token_len_per_gpu: int = "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    """Token budget per reference forward pass when dynamic."""
    fsdp_config: RefFSDPConfig = field(default_factory=RefFSDPConfig)
    """FSDP settings of the reference model."""
    use_prefix_grouper: bool = "${actor_rollout_ref.actor.use_prefix_grouper}"  # type: ignore[assignment]
    """Follows the actor: the reference pass encodes each distinct prompt once."""
    ulysses_sequence_parallel_size: int = "${actor_rollout_ref.actor.ulysses_sequence_parallel_size}"  # type: ignore[assignment]
    """Follows the actor."""
    entropy_from_logits_with_chunking: bool = False
    """Accepted for compatibility."""
    entropy_checkpointing: bool = False
    """Accepted for compatibility."""


@_cfg()
class SamplingConfig:
    top_k: int = -1
    """Top-k sampling (-1: off)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    temperature: float = 0.0
    """Sampling temperature (0: greedy)."""
    n: int = 1
    """Samples per prompt in validation."""
    do_sample: bool = False
    """Sample (true) or decode greedily (false)."""


@_cfg()
class MultiTurnConfig:
    enable: bool = False
    """Multi-turn rollout: the model may call tools (and an interaction may answer) between its turns (`posttrain.rollout.multi_turn`)."""
    max_assistant_turns: Optional[int] = None
    """Most assistant turns per trajectory (null: no limit but the response length)."""
    tool_config_path: Optional[str] = None
    """Tool config YAML (`tools: [{class_name, config, tool_schema}]`); null for no tools from a file."""
    max_user_turns: Optional[int] = None
    """Most tool/user turns per trajectory (null: no limit but the response length)."""
    max_parallel_calls: int = 1
    """Tool calls running at once, over all trajectories of a batch (calls past it in one turn wait)."""
    max_tool_response_length: int = 256
    """Characters of a tool's answer kept; the rest is cut (tool_response_truncate_side)."""
    tool_response_truncate_side: str = "middle"
    """Which part of a long tool answer is kept: left (its start), right (its end) or middle (both ends)."""
    interaction_config_path: Optional[str] = None
    """Interaction config YAML (`interaction: [{name, class_name, config}]`); null for no interaction."""
    use_inference_chat_template: bool = False
    """Accepted for compatibility; posttrain always trains on the recorded token ids (false)."""
    tokenization_sanity_check_mode: str = "strict"
    """Accepted for compatibility (disable, strict, ignore_strippable); no re-tokenization happens, so nothing to check."""
    format: str = "hermes"
    """Tool-call format in the model's text: hermes (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`)."""
    tool_timeout_s: float = 30.0
    """(posttrain) Seconds one tool call may take (> 0); past it the model reads an error message instead."""
    interaction_timeout_s: float = 30.0
    """(posttrain; verl has none) Seconds one call of an interaction's method may take (> 0); past it the call is abandoned and counted (multi_turn/interaction_timeouts)."""
    add_tool_rewards: bool = False
    """(posttrain) Add each trajectory's tool rewards (calc_reward) and interaction score to the reward function's score."""
    max_consecutive_invalid_tool_calls: Optional[int] = None
    """(posttrain; verl PR 7697's name) Invalid tool calls in a row (bad JSON, unknown tool, wrong arguments) that end a trajectory; null: no cap."""
    function_tool_path: Optional[str] = None
    """verl's Python file of plain functions offered as tools; not supported yet: must stay null (write a tool YAML for tool_config_path; posttrain.tools.function_tool wraps a function)."""
    filter_void_turns: bool = False
    """(posttrain) Trajectories with a void turn (no tool call, no final answer; SimpleTIR) get zero loss weight (response_mask 0)."""
    final_answer_pattern: Optional[str] = None
    """(posttrain) Regex a final answer matches (e.g. '####'); a turn without calls that misses it is void (null: only a blank turn is)."""


@_cfg()
class AgentEpisodeConfig:
    path: Optional[str] = None
    """(posttrain) A Python file defining the agent: async def episode(client, row) -> float, given an
    openai.AsyncOpenAI client bound to that episode (the policy served with the current weights); the
    return value is the reward. Set path (with name) or command to train agent programs."""
    name: str = "episode"
    """(posttrain) The episode function's name in path."""
    command: Optional[str] = None
    """(posttrain) A shell command run once per episode instead of a function, with OPENAI_BASE_URL,
    OPENAI_API_KEY, OPENAI_MODEL and POSTTRAIN_ROW (the row as JSON) in its environment; its reward is the
    last line it prints. Exiting non-zero is a failed episode."""
    model_name: str = "policy"
    """(posttrain) The model name episodes send (any other is refused with 404 and counted)."""
    timeout_s: float = 300.0
    """(posttrain) Seconds an episode may run (> 0); one past it is abandoned and counted as failed."""
    max_concurrent: int = 64
    """(posttrain) Episodes running at once (their calls are decoded together in batches)."""


@_cfg()
class AgentLoopConfig:
    num_workers: int = 8
    """Accepted for compatibility: posttrain drives all trajectories from one loop per rank."""
    default_agent_loop: str = "tool_agent"
    """Loop for rows without an agent_name column when multi_turn.enable: tool_agent or single_turn_agent."""
    agent_loop_config_path: Optional[str] = None
    """Custom agent loops (not supported yet; must stay null)."""
    episode: AgentEpisodeConfig = field(default_factory=AgentEpisodeConfig)
    """(posttrain) Agent programs trained through an OpenAI-compatible endpoint (posttrain.agents)."""


@_cfg()
class EngineKwargsConfig:
    vllm: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for vLLM."""
    sglang: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for SGLang."""


@_cfg()
class RolloutConfig:
    name: str = "hf"
    """Generation engine: hf (transformers generate), vllm, sglang. verl requires it set; posttrain defaults to hf."""
    mode: str = "async"
    """sync or async rollout (engine scheduling mode)."""
    temperature: float = 1.0
    """Sampling temperature during training rollouts; log-probs use it too."""
    top_k: int = -1
    """Top-k sampling (-1: off)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    prompt_length: int = "${data.max_prompt_length}"  # type: ignore[assignment]
    """Follows data.max_prompt_length."""
    response_length: int = "${data.max_response_length}"  # type: ignore[assignment]
    """Follows data.max_response_length."""
    dtype: str = "bfloat16"
    """Dtype of the inference engine."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory the inference engine may take (weights + KV cache)."""
    ignore_eos: bool = False
    """Keep generating past EOS."""
    enforce_eager: bool = False
    """Disable CUDA graphs in the engine."""
    lean_decode: bool = True
    """posttrain's hf engine: decode Llama-family models (llama, mistral, qwen2) with posttrain.rollout.lean_decoder, fewer ops per token and MKL-packed fp32 weights, the same tokens and log-probs; False runs the model's own forward at every decoding step."""
    free_cache_engine: bool = True
    """Release the KV cache between rollouts."""
    tensor_model_parallel_size: int = 2
    """GPUs per inference-engine instance (verl). Read and not applied: posttrain runs one engine with tensor
    parallel size 1 on every rank, each holding the full weights."""
    max_num_batched_tokens: int = 8192
    """Engine scheduler token budget."""
    max_model_len: Optional[int] = None
    """Engine context length (default prompt + response length)."""
    max_num_seqs: int = 1024
    """Engine concurrent sequences."""
    log_prob_micro_batch_size: Optional[int] = None
    """Deprecated global micro-batch size; use log_prob_micro_batch_size_per_gpu."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    """Responses per old-log-prob forward pass on one rank."""
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    """Pack log-prob passes by tokens."""
    log_prob_max_token_len_per_gpu: int = "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    """Token budget per log-prob pass when dynamic."""
    disable_log_stats: bool = True
    """Silence engine statistics."""
    do_sample: bool = True
    """Sample (true) or greedy (false) in training rollouts."""
    n: int = 1
    """Responses sampled per prompt (the group size for GRPO/RLOO)."""
    over_sample_rate: float = 0.0
    """Fraction of extra requests to drop stragglers (not supported yet; must stay 0)."""
    engine_kwargs: EngineKwargsConfig = field(default_factory=EngineKwargsConfig)
    """Per-engine extra arguments."""
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling for validation."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn settings."""
    agent: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    """Agent-loop settings (multi_turn.enable)."""
    calculate_log_probs: bool = True
    """Record the engine's log-probs of sampled tokens (compared with the actor's: training/rollout_actor_probs_diff_*)."""
    seed_per_batch: bool = False
    """(posttrain) Seed each training batch's sampling from trainer.seed, its step and its first prompt (`posttrain.rollout.seeding`) instead of drawing from one random stream per process: runs that differ only in where rollouts run (colocated, or async at staleness 0) draw the same random numbers for the same batch. hf engine only."""
    load_format: str = "dummy_dtensor"
    """How the engine receives initial weights."""
    layered_summon: bool = False
    """Gather FSDP weights layer by layer for the engine."""
    enable_chunked_prefill: bool = True
    """Engine chunked prefill."""
    enable_prefix_caching: bool = True
    """Engine reuses the KV cache of shared prompt prefixes (reset after every weight push)."""
    logprobs_mode: str = "processed_logprobs"
    """Which engine log-probs rollout_log_probs hold: processed_logprobs (after temperature and top-k/top-p) or raw_logprobs."""
    nnodes: int = 1
    """Machines of the rollout pool (actor_rollout_ref.hybrid_engine=False: rollout workers apart from the trainer)."""
    n_gpus_per_node: int = 0
    """Rollout workers per machine, each on its own device (on CPU: its own share of cores); 0: no rollout pool."""
    total_rollout_steps: Optional[int] = None
    """Prompts the rollout pool generates in the run (verl's fully-async key; null: trainer.total_training_steps x data.train_batch_size)."""


@_cfg()
class ActorModelConfig:
    path: str = "~/models/deepseek-llm-7b-chat"
    """Policy model: a local HF folder, a hub id, a .gguf file, or smollm2-135m-instruct."""
    custom_chat_template: Optional[str] = None
    """Jinja chat template replacing the tokenizer's."""
    use_shm: bool = False
    """Copy the model to shared memory before loading."""
    external_lib: Optional[str] = None
    """Module to import before loading (registers custom models)."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Entries that override the model's HF config (e.g. attention_dropout)."""
    enable_gradient_checkpointing: bool = True
    """Recompute activations in backward to save memory."""
    enable_activation_offload: bool = False
    """Offload activations to CPU."""
    use_remove_padding: bool = False
    """Drop padding tokens before the forward pass (packed sequences)."""
    lora_rank: int = 0
    """LoRA rank (0: full fine-tuning); > 0 trains peft LoRA adapters on a frozen base, and the reference policy is the actor with its adapters disabled (no second model)."""
    lora_alpha: int = 16
    """LoRA alpha: the adapter's update is scaled by lora_alpha / lora_rank."""
    target_modules: Any = "all-linear"
    """Layers given adapters: all-linear (every nn.Linear but lm_head), a list of module names (q_proj, v_proj, ...), or a regex on full module names."""
    exclude_modules: Any = None
    """Modules kept without adapters: a list of module names or a regex on full module names."""
    lora_adapter_path: Optional[str] = None
    """A peft LoRA adapter folder (save_pretrained) to start from; its own rank, alpha and target modules apply."""
    use_liger: bool = False
    """Use Liger kernels."""
    use_fused_kernels: bool = False
    """Use fused log-prob/entropy kernels."""
    compile_layers: bool = False
    """(posttrain) Run the decoder layers through torch.compile (dynamic shapes) in the actor's log-prob and update passes, the reference pass and the critic's passes, not in generation. Fusing their elementwise work makes those passes faster on CPUs after a first compilation of about a minute (cached on disk by inductor; needs g++; figures: benchmarks/README.md, "Compiled layers"). One rank only (not with FSDP2 sharding)."""
    trust_remote_code: bool = False
    """Allow model code from the checkpoint folder to run."""


@_cfg()
class ActorRolloutRefConfig:
    hybrid_engine: bool = True
    """Actor and rollout share one set of weights on the same devices; False: a separate rollout pool generates while the trainer updates (async_training.*)."""
    nccl_timeout: int = 600
    """Collective timeout in seconds (> 0)."""
    model: ActorModelConfig = field(default_factory=ActorModelConfig)
    """The policy model."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy training."""
    ref: RefConfig = field(default_factory=RefConfig)
    """Frozen reference policy (for KL)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Response generation."""
