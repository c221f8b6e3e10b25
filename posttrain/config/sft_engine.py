"""verl 0.9's engine SFT tree (`verl/trainer/config/sft_trainer_engine.yaml` with its defaults: `model`,
`engine`, `optim`, `checkpoint`, `profiler`, `data`, `trainer`) and its mapping onto posttrain's SFT tree.

``python -m verl.trainer.sft_trainer`` is verl 0.9's SFT: chat-message rows (``data.messages_key``, with
``tools_key`` and ``enable_thinking_key``), micro-batches by rows or by tokens, an engine section in place of
``model.fsdp_config``. posttrain reads that tree here and runs it as its SFT run
(`posttrain.config.sft.SFTConfig` on the RL workers): the same trainer, checkpoints and exported model as
``python -m posttrain.trainer.fsdp_sft_trainer``. Hydra's group choices in a launch script (``engine=fsdp``,
``optim=fsdp``, ``model=hf_model``) are read too; a group for a back-end posttrain lacks (``engine=megatron``)
is one error naming it.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any, Iterable, Optional

from posttrain.config.actor_rollout_ref import FSDPConfig, MixedPrecisionConfig, WrapPolicyConfig, _cfg
from posttrain.config.sft import SFTConfig, SFTMultiTurnConfig
from posttrain.config.verl_keys import VerlRule
from posttrain.errors import ConfigError

__all__ = ["EngineSFTConfig", "GROUP_CHOICES", "load_engine_sft_config", "to_sft_config"]


@_cfg()
class EngineSFTDataConfig:
    train_batch_size: int = 256
    """Rows per optimizer step, over all ranks."""
    micro_batch_size_per_gpu: int = 4
    """Rows per forward/backward on one rank (with use_dynamic_bsz=False); also the validation batch."""
    max_token_len_per_gpu: int = 8192
    """Tokens per forward/backward on one rank (with use_dynamic_bsz=True)."""
    use_dynamic_bsz: bool = True
    """Pack micro-batches by tokens (max_token_len_per_gpu) instead of rows."""
    train_files: Any = "~/data/gsm8k/train.parquet"
    """Training rows: a parquet/jsonl file or a list of them; each row holds chat messages (messages_key)."""
    val_files: Any = None
    """Held-out rows for the validation loss (null: none)."""
    train_max_samples: int = -1
    """Use only the first N training rows (-1: all)."""
    val_max_samples: int = -1
    """Use only the first N validation rows (-1: all)."""
    messages_key: str = "messages"
    """Column holding the chat messages ([{role, content}, ...]); every assistant message is trained."""
    tools_key: str = "tools"
    """Column holding the tool schemas passed to the chat template (optional per row)."""
    enable_thinking_key: str = "enable_thinking"
    """Column whose value is passed to the chat template as enable_thinking (optional per row)."""
    enable_thinking_default: Any = "none"
    """enable_thinking where the row has no such column: none (not passed), true or false."""
    pad_mode: str = "no_padding"
    """verl's engine input layout (no_padding: packed); posttrain packs with model.use_remove_padding."""
    max_length: int = 1024
    """Most tokens of one row."""
    truncation: str = "error"
    """A row over max_length: error, left or right."""
    balance_dp_token: bool = False
    """Balance tokens over ranks (not implemented in verl either)."""
    custom_cls: dict[str, Any] = field(default_factory=lambda: {"path": None, "name": None})
    """A custom dataset class (not supported: path must stay null)."""
    use_shm: bool = False
    """Copy the data to shared memory first (no effect: rows are read once)."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the chat template."""
    num_workers: int = 8
    """Loader processes (no effect: rows are tokenised up front)."""
    ignore_input_ids_mismatch: bool = False
    """verl's check that incremental and whole-conversation tokenisation agree (posttrain tokenises the whole conversation once)."""


@_cfg()
class EngineModelConfig:
    path: str = "~/models/deepseek-llm-7b-chat"
    """Model to train: a local HF folder, a hub id, a .gguf file, or smollm2-135m-instruct."""
    tokenizer_path: Optional[str] = None
    """Tokenizer (null: the model's; set: must be the model's, as posttrain reads it from path)."""
    use_shm: bool = False
    """Copy the model to shared memory first (no effect)."""
    trust_remote_code: bool = False
    """Allow model code from the model folder to run."""
    custom_chat_template: Optional[str] = None
    """Jinja chat template replacing the tokenizer's."""
    external_lib: Optional[str] = None
    """Module imported before loading (registers custom models)."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Entries that override the model's HF config."""
    enable_gradient_checkpointing: bool = True
    """Recompute activations in backward to save memory."""
    enable_activation_offload: bool = False
    """Offload activations to the host (GPU memory trick; no effect here)."""
    use_remove_padding: bool = True
    """Pack a micro-batch's valid tokens into one row (no padding computed)."""
    lora_rank: int = 0
    """LoRA rank (0: full fine-tuning)."""
    lora_alpha: int = 16
    """LoRA alpha."""
    target_modules: Any = "all-linear"
    """Layers given adapters."""
    exclude_modules: Any = None
    """Modules kept without adapters."""
    lora_adapter_path: Optional[str] = None
    """A peft LoRA adapter folder to start from."""
    use_liger: bool = False
    """Liger kernels (GPU; refused when true)."""
    use_fused_kernels: bool = False
    """verl's fused log-prob kernels (no effect: posttrain's head is its own)."""


@_cfg()
class EngineFSDPConfig:
    wrap_policy: WrapPolicyConfig = field(default_factory=WrapPolicyConfig)
    """FSDP wrapping policy."""
    param_offload: bool = False
    """Keep parameters in host memory between uses."""
    optimizer_offload: bool = False
    """Keep optimizer state in host memory (on a one-process CPU run: paged to a file)."""
    offload_policy: bool = False
    """FSDP2 CPUOffloadPolicy."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward."""
    fsdp_size: int = -1
    """Ranks per FSDP group (-1: all)."""
    forward_prefetch: bool = False
    """Prefetch the next layer's parameters in forward."""
    model_dtype: str = "fp32"
    """dtype the weights are held in (fp32 master weights)."""
    dtype: str = "bfloat16"
    """Compute dtype: bfloat16 (posttrain: bf16 where this machine computes in bf16, else fp32), float16 or float32."""
    strategy: str = "fsdp"
    """fsdp or fsdp2 (both FSDP2 here)."""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses sequence parallelism (not in posttrain: values > 1 are refused)."""
    seed: int = 42
    """Engine seed (posttrain: trainer.seed)."""


GROUP_CHOICES: dict[str, tuple[tuple[str, ...], str]] = {
    "engine": (("fsdp", "fsdp2"), "engine"),
    "optim": (("fsdp", "fsdp2"), "optimizer"),
    "model": (("hf_model",), "model"),
    "profiler": (("profiler",), "profiler"),
}
"""Hydra's config-group choices verl's SFT scripts pass (``engine=fsdp``): the ones posttrain reads."""


@_cfg()
class EngineOptimConfig:
    optimizer: str = "AdamW"
    """Optimizer class (verl's name: AdamW), posttrain_adamw_8bit, or auto (posttrain's choice for the machine)."""
    optimizer_impl: str = "torch.optim"
    """Module of the optimizer class (torch.optim, posttrain.optim, torchao.optim, ...)."""
    lr: float = 1e-3
    """Learning rate (verl's engine default; its scripts set optim.lr)."""
    lr_warmup_steps_ratio: float = 0.0
    """Warm-up steps as a fraction of the total steps."""
    total_training_steps: int = -1
    """Schedule length (-1: the run's steps)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    lr_warmup_steps: int = -1
    """Warm-up steps (-1: lr_warmup_steps_ratio)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    clip_grad: float = 1.0
    """Clip the gradient norm to this."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of lr."""
    num_cycles: float = 0.5
    """Cosine cycles over the schedule."""
    lr_scheduler_type: str = "constant"
    """constant or cosine."""
    zero_indexed_step: bool = True
    """The schedule counts from step 0 (posttrain always does)."""
    warmup_style: Optional[str] = None
    """Deprecated name of lr_scheduler_type; when set it wins."""
    override_optimizer_config: Optional[dict[str, Any]] = None
    """Extra constructor arguments of the optimizer."""


@_cfg()
class EngineCheckpointConfig:
    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """What a checkpoint holds (posttrain always writes model, optimizer and extra, so every checkpoint resumes exactly; hf_model also exports a Hugging Face folder at the end)."""
    load_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """What resume loads (posttrain resumes the whole state)."""


@_cfg()
class EngineSFTTrainerConfig:
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    """Checkpoint folder."""
    default_hdfs_dir: Optional[str] = None
    """Remote checkpoint copy (not supported: must stay null)."""
    project_name: str = "gsm8k-sft"
    """Project name."""
    experiment_name: str = "test"
    """Run name."""
    total_epochs: int = 4
    """Passes over the training rows."""
    total_training_steps: Optional[int] = None
    """Stop after this many steps (null: total_epochs x steps per epoch)."""
    logger: list[str] = field(default_factory=lambda: ["console", "wandb"])
    """Metric back ends."""
    seed: int = 1
    """Seed of initialisation and shuffling."""
    save_freq: int = -1
    """Save every this many steps (the last step always)."""
    test_freq: int = -1
    """Validation loss every this many steps (the last step always)."""
    max_ckpt_to_keep: Optional[int] = None
    """Keep only the newest N checkpoints."""
    balance_batch: bool = True
    """Balance tokens over ranks (no effect: ranks take contiguous rows)."""
    resume_mode: str = "auto"
    """auto, disable or resume_path."""
    resume_from_path: Optional[str] = None
    """Checkpoint folder for resume_mode=resume_path."""
    device: str = "cuda"
    """cuda, cpu or auto (posttrain: cuda where present, else the CPU; verl's default cuda runs on the CPU here when there is no GPU)."""
    nnodes: int = 1
    """Machines (Ray ranks; under torchrun the launcher's world size wins)."""
    n_gpus_per_node: int = 1
    """Ranks per machine."""
    profile_interval: list[int] = field(default_factory=lambda: [-1, -1])
    """Steps profiled (no effect: posttrain has no profiler hooks)."""


@_cfg()
class EngineSFTConfig:
    """`python -m posttrain.trainer.sft_trainer`: verl 0.9's engine SFT keys."""

    model: EngineModelConfig = field(default_factory=EngineModelConfig)
    """The model trained."""
    engine: EngineFSDPConfig = field(default_factory=EngineFSDPConfig)
    """The training engine (FSDP2)."""
    optim: EngineOptimConfig = field(default_factory=EngineOptimConfig)
    """Optimizer and schedule."""
    checkpoint: EngineCheckpointConfig = field(default_factory=EngineCheckpointConfig)
    """Checkpoint contents."""
    data: EngineSFTDataConfig = field(default_factory=EngineSFTDataConfig)
    """Chat-message rows."""
    trainer: EngineSFTTrainerConfig = field(default_factory=EngineSFTTrainerConfig)
    """The training loop."""
    no_effect: list[str] = field(default_factory=list)
    """(posttrain; filled by the loader) verl keys this run sets that have no effect here."""


_PROFILER = "verl's profiler hooks are not in posttrain (phases are timed in metrics.jsonl)"
ENGINE_SFT_NO_EFFECT: tuple[VerlRule, ...] = (
    VerlRule("profiler.*", _PROFILER),
    VerlRule("model.hf_config_path", "the model's config is read from model.path", accepts=(None,),
             instead="set it null"),
    VerlRule("model.fused_kernel_options.*", "verl's fused-kernel back-end choice"),
    VerlRule("model.tiled_mlp.enabled", "tiled MLP is not in posttrain", accepts=(False, None), instead="set False"),
    VerlRule("model.tiled_mlp.*", "settings of tiled MLP"),
    VerlRule("model.mtp.enable", "multi-token prediction needs verl's Megatron engine", accepts=(False, None),
             instead="set False"),
    VerlRule("model.mtp.*", "settings of multi-token prediction"),
    VerlRule("model.lora.rank", "verl's Megatron LoRA; with FSDP, LoRA is model.lora_rank", accepts=(0, None),
             instead="set model.lora_rank instead"),
    VerlRule("model.lora.*", "settings of verl's Megatron LoRA (FSDP LoRA is model.lora_rank, lora_alpha, "
             "target_modules)"),
    VerlRule("engine.offload_policy", "FSDP2 CPUOffloadPolicy is engine.param_offload here"),
    VerlRule("engine.use_orig_params", "an FSDP1 switch; posttrain shards with FSDP2"),
    VerlRule("engine.full_determinism", "a CPU run is bit-reproducible from trainer.seed already"),
    VerlRule("engine.entropy_from_logits_with_chunking", "SFT computes no entropy"),
    VerlRule("engine.entropy_from_logits_chunk_size", "SFT computes no entropy"),
    VerlRule("engine.use_torch_compile", "decoder layers compile with model.compile_layers in the RL tree"),
    VerlRule("engine.entropy_checkpointing", "SFT computes no entropy"),
    VerlRule("engine.use_no_sync_for_gradient_accumulation", "an FSDP1 switch"),
    VerlRule("engine.pad_to_length", "posttrain packs or pads micro-batches itself"),
    VerlRule("engine.pad_to_length_bucket", "posttrain packs or pads micro-batches itself"),
    VerlRule("engine.forward_only", "an engine-internal switch"),
    VerlRule("engine.qat.enable", "quantization-aware training needs verl's QAT engine", accepts=(False, None),
             instead="set False"),
    VerlRule("engine.qat.*", "settings of quantization-aware training"),
    VerlRule("engine.turbo_config.*", "settings of verl's fsdp_turbo engine"),
)
"""verl 0.9.1 engine-SFT keys with no field here (`posttrain.config.verl_keys`' rules, for this tree)."""


def _group_choices(overrides: Iterable[str]) -> list[str]:
    """The overrides without Hydra's group choices (``engine=fsdp``), each checked."""
    from posttrain.config.verl_keys import backend_refusal

    kept = []
    for item in overrides:
        key, _, value = item.lstrip("+").partition("=")
        if key in GROUP_CHOICES and "=" in item:
            valid, what = GROUP_CHOICES[key]
            if value not in valid:
                refusal = backend_refusal("engine.strategy", value) if key in ("engine", "optim") else None
                raise ConfigError(f"override '{item}': {refusal or f'{what} group {value!r} is not one posttrain has'}"
                                  f" (valid: {', '.join(valid)})")
            continue
        kept.append(item)
    return kept


def engine_sft_tree() -> Any:
    """The loader's view of this tree (`posttrain.config.load.Tree`): its keys, no aliases, its no-effect rules."""
    from posttrain.config.load import Tree

    return Tree(EngineSFTConfig, "SFT ", aliases=(), no_effect=ENGINE_SFT_NO_EFFECT)


def load_engine_sft_config(path: Any = None, overrides: Iterable[str] = ()) -> EngineSFTConfig:
    """verl 0.9's engine SFT defaults <- ``path`` YAML <- overrides (the RL loader's rules and errors)."""
    from posttrain.config.load import load_raw, to_dataclass

    return to_dataclass(load_raw(path, _group_choices(overrides), None, engine_sft_tree()))


_DTYPE = {"bfloat16": "auto", "bf16": "auto", "float16": "fp16", "fp16": "fp16", "float32": "fp32", "fp32": "fp32"}
"""engine.dtype -> posttrain's param_dtype. verl's bfloat16 is "bf16 where the machine computes in it": auto
picks bf16 on a GPU or a CPU with bf16 instructions, fp32 on a CPU without them."""


def to_sft_config(engine: EngineSFTConfig) -> SFTConfig:
    """posttrain's SFT tree for verl 0.9's engine tree (its rows are chat messages: multi-turn mode)."""
    for problem in _engine_problems(engine):
        raise ConfigError(problem)
    config = SFTConfig()
    _map_data(engine, config)
    _map_model(engine, config)
    _map_optim(engine, config)
    _map_trainer(engine, config)
    return config


def _map_data(engine: EngineSFTConfig, config: SFTConfig) -> None:
    e, d = engine.data, config.data
    d.train_files, d.val_files = e.train_files, e.val_files
    d.train_batch_size, d.micro_batch_size_per_gpu = e.train_batch_size, e.micro_batch_size_per_gpu
    d.use_dynamic_bsz, d.max_token_len_per_gpu = e.use_dynamic_bsz, e.max_token_len_per_gpu
    d.train_max_samples, d.val_max_samples = e.train_max_samples, e.val_max_samples
    d.max_length, d.truncation = e.max_length, e.truncation
    d.multiturn = SFTMultiTurnConfig(enable=True, messages_key=e.messages_key, tools_key=e.tools_key,
                                     enable_thinking_key=e.enable_thinking_key)
    d.apply_chat_template_kwargs = dict(e.apply_chat_template_kwargs)
    default = str(e.enable_thinking_default).lower()
    if default in ("true", "false"):
        d.apply_chat_template_kwargs.setdefault("enable_thinking", default == "true")
    d.chat_template = engine.model.custom_chat_template


def _map_model(engine: EngineSFTConfig, config: SFTConfig) -> None:
    e, m, g = engine.model, config.model, engine.engine
    m.partial_pretrain, m.trust_remote_code, m.external_lib = e.path, e.trust_remote_code, e.external_lib
    m.enable_gradient_checkpointing, m.override_config = e.enable_gradient_checkpointing, dict(e.override_config)
    m.lora_rank, m.lora_alpha, m.target_modules = e.lora_rank, e.lora_alpha, e.target_modules
    m.exclude_modules, m.lora_adapter_path, m.use_liger = e.exclude_modules, e.lora_adapter_path, e.use_liger
    config.use_remove_padding = e.use_remove_padding
    config.ulysses_sequence_parallel_size = g.ulysses_sequence_parallel_size
    m.fsdp_config = FSDPConfig(
        wrap_policy=g.wrap_policy, param_offload=g.param_offload, optimizer_offload=g.optimizer_offload,
        reshard_after_forward=g.reshard_after_forward, fsdp_size=g.fsdp_size, forward_prefetch=g.forward_prefetch,
        model_dtype=g.model_dtype, mixed_precision=MixedPrecisionConfig(param_dtype=_DTYPE[str(g.dtype)]))


def _map_optim(engine: EngineSFTConfig, config: SFTConfig) -> None:
    e, o = engine.optim, config.optim
    o.lr, o.betas, o.weight_decay, o.clip_grad = e.lr, list(e.betas), e.weight_decay, e.clip_grad
    o.lr_warmup_steps_ratio, o.lr_warmup_steps, o.min_lr_ratio = e.lr_warmup_steps_ratio, e.lr_warmup_steps, e.min_lr_ratio
    o.lr_scheduler = e.warmup_style or e.lr_scheduler_type
    o.optimizer = "auto" if e.optimizer == "AdamW" and e.optimizer_impl == "torch.optim" else e.optimizer
    o.optimizer_impl, o.override_optimizer_config = e.optimizer_impl, e.override_optimizer_config


def _map_trainer(engine: EngineSFTConfig, config: SFTConfig) -> None:
    e, t = engine.trainer, config.trainer
    for name in ("default_local_dir", "default_hdfs_dir", "project_name", "experiment_name", "total_epochs",
                 "total_training_steps", "seed", "save_freq", "test_freq", "max_ckpt_to_keep", "resume_mode",
                 "resume_from_path", "nnodes", "n_gpus_per_node"):
        setattr(t, name, getattr(e, name))
    t.logger = list(e.logger)
    t.device = "auto" if e.device == "cuda" else e.device  # verl's default names the GPU; here: a GPU where present
    t.checkpoint.save_contents = list(engine.checkpoint.save_contents)
    t.checkpoint.load_contents = list(engine.checkpoint.load_contents)


def _engine_problems(engine: EngineSFTConfig) -> Iterable[str]:
    g, d = engine.engine, engine.data
    if str(g.dtype) not in _DTYPE:
        yield f"engine.dtype={g.dtype!r} is not one of: bfloat16, float16, float32"
    if g.strategy not in ("fsdp", "fsdp2"):
        from posttrain.config.verl_keys import backend_refusal

        yield backend_refusal("engine.strategy", g.strategy) or f"engine.strategy={g.strategy!r}: valid fsdp, fsdp2"
    if d.custom_cls.get("path"):
        yield f"data.custom_cls.path={d.custom_cls['path']!r}: a custom dataset class is not supported; set it null"
    if str(d.enable_thinking_default).lower() not in ("none", "true", "false"):
        yield f"data.enable_thinking_default={d.enable_thinking_default!r} is not one of: none, true, false"
    if engine.model.tokenizer_path not in (None, engine.model.path):
        yield (f"model.tokenizer_path={engine.model.tokenizer_path!r}: posttrain reads the tokenizer from model.path "
               f"({engine.model.path}); set it null")
