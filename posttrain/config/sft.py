"""The SFT and DPO trainers' config trees: verl's `sft_trainer.yaml` keys, plus TRL's DPO knobs.

`SFTConfig` holds verl's keys for `python -m verl.trainer.fsdp_sft_trainer` (defaults are verl's,
except where marked "(posttrain)"); `DPOConfig` is the same tree with `data.chosen_key` /
`data.rejected_key` and a `dpo` section under TRL's names. Loading, validation, the mapping onto
the RL workers' config and the key reference are in `posttrain.config.sft_load`.
"""

from __future__ import annotations

import difflib
import io
from dataclasses import dataclass, field
from typing import Any, Optional

from posttrain.config.actor_rollout_ref import FSDPConfig, MixedPrecisionConfig
from posttrain.errors import ConfigError

__all__ = ["DPOConfig", "DPODataConfig", "DPOSection", "SFTConfig", "SFTDataConfig", "SFTModelConfig",
           "SFTMultiTurnConfig", "SFTOptimConfig", "SFTTrainerConfig"]

TRUNCATION_MODES = ("error", "left", "right")
ON_BAD_ROW = ("error", "skip")
"""``data.on_bad_row``'s values: those `posttrain.data.preference.PreferenceDataset` takes (config may not
import the data room, so the tuple is written here too; a test keeps the two equal)."""
SIMPO_GAMMA = 0.5
"""``dpo.simpo_gamma``'s default (TRL's CPOConfig)."""
CPO_ALPHA = 0.0
"""``dpo.cpo_alpha``'s default: SimPO without the NLL term (TRL's CPOConfig defaults to 1.0, CPO-SimPO)."""


def _cfg(**kwargs):
    return dataclass(kw_only=True, **kwargs)


def _sft_fsdp() -> FSDPConfig:
    """verl's SFT trains fp32 master weights; posttrain computes in fp32 unless told otherwise."""
    return FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))


@_cfg()
class SFTMultiTurnConfig:
    enable: bool = False
    """Rows hold a list of chat messages (data.multiturn.messages_key); every assistant message is trained."""
    messages_key: str = "messages"
    """Column holding the messages ([{role, content}, ...])."""
    tools_key: str = "tools"
    """Column holding the tool schemas passed to the chat template (optional per row)."""
    enable_thinking_key: str = "enable_thinking"
    """Column whose value is passed to the chat template as enable_thinking (optional per row)."""


@_cfg()
class SFTArithmeticConfig:
    n_train: int = 1024
    """(posttrain) Training problems of the built-in arithmetic SFT data (used when data.train_files is null)."""
    n_test: int = 128
    """(posttrain) Held-out problems (data.val_files null)."""
    digits: int = 2
    """(posttrain) Digits per operand."""
    seed: int = 0
    """(posttrain) Seed of the problems."""
    prompt_style: str = "fewshot"
    """(posttrain) How each problem is asked (the RL built-in run's style, so an SFT model continues with GRPO on the same prompts)."""


@_cfg()
class SFTDataConfig:
    train_files: Any = "~/data/gsm8k/train.parquet"
    """Training rows: a parquet/jsonl file or a list of them (null: the built-in arithmetic task, posttrain)."""
    val_files: Any = "~/data/gsm8k/test.parquet"
    """Held-out rows for the validation loss (null: none, or the built-in task's when train_files is null)."""
    train_batch_size: int = 256
    """Rows per optimizer step, over all ranks."""
    micro_batch_size: Optional[int] = None
    """Deprecated verl name: rows per forward over all ranks; use micro_batch_size_per_gpu."""
    micro_batch_size_per_gpu: int = 4
    """Rows per forward/backward on one rank (gradient accumulation up to the batch); also the validation batch."""
    use_dynamic_bsz: bool = False
    """Pack micro-batches by tokens (max_token_len_per_gpu) instead of rows (verl 0.9's engine SFT key)."""
    max_token_len_per_gpu: int = 8192
    """Tokens per forward/backward on one rank with use_dynamic_bsz."""
    train_max_samples: int = -1
    """Use only the first N training rows (-1: all)."""
    val_max_samples: int = -1
    """Use only the first N validation rows (-1: all)."""
    prompt_key: str = "question"
    """Column holding the prompt: text (templated as one user turn) or a list of chat messages."""
    response_key: str = "answer"
    """Column holding the response text."""
    prompt_dict_keys: Optional[list[str]] = None
    """Keys into a dict-valued prompt column (e.g. prompt_key=extra_info prompt_dict_keys=[question])."""
    response_dict_keys: Optional[list[str]] = None
    """Keys into a dict-valued response column (e.g. response_key=extra_info response_dict_keys=[answer])."""
    multiturn: SFTMultiTurnConfig = field(default_factory=SFTMultiTurnConfig)
    """Multi-turn rows."""
    max_length: int = 1024
    """Most tokens of prompt + response in one row."""
    truncation: str = "error"
    """A row over max_length: error (names file and row), left (drop the prompt's first tokens), right (drop the response's last tokens)."""
    balance_dp_token: bool = False
    """Accepted for verl compatibility (ranks get contiguous rows)."""
    chat_template: Optional[str] = None
    """Jinja chat template replacing the tokenizer's."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the chat template (e.g. enable_thinking)."""
    shuffle: bool = True
    """(posttrain) Shuffle the training rows each epoch."""
    seed: Optional[int] = None
    """(posttrain) Seed of the shuffle (null: trainer.seed)."""
    arithmetic: SFTArithmeticConfig = field(default_factory=SFTArithmeticConfig)
    """(posttrain) The built-in arithmetic SFT data."""


SELF_PAIR_REWARD_KEYS = ("flexible_acc", "score", "acc")
"""The built-in arithmetic scorer's fields (`posttrain.rewards.arithmetic`) that can say a sample is correct."""


@_cfg()
class SelfPairsConfig:
    prompts: int = 64
    """(posttrain) With data.train_files null, pairs come from the model's own samples (`posttrain prep pairs`): this many training prompts of the built-in arithmetic task (data.arithmetic.*) are sampled."""
    n: int = 4
    """(posttrain) Samples per prompt; a prompt with a correct and a wrong sample gives a pair (chosen: the correct one)."""
    temperature: float = 1.0
    """(posttrain) Sampling temperature (> 0: the samples must differ)."""
    max_new_tokens: int = 48
    """(posttrain) Most tokens per sample."""
    reward_key: str = "flexible_acc"
    """(posttrain) The arithmetic scorer's field that says a sample is correct (1.0): flexible_acc (the last number is the answer) or score (the answer after ####)."""
    batch_size: int = 32
    """(posttrain) Prompts per generation batch."""


@_cfg()
class DPODataConfig(SFTDataConfig):
    train_files: Any = None
    """Preference rows (prompt, chosen, rejected): parquet/jsonl file(s), e.g. from `posttrain prep pairs` (null: the model's own pairs, data.self_pairs.*)."""
    val_files: Any = None
    """Held-out preference rows for eval_loss and eval_rewards/* (null: none)."""
    prompt_key: str = "prompt"
    """Column holding the prompt: text or a list of chat messages (TRL's name)."""
    chosen_key: str = "chosen"
    """Column holding the preferred response: text or chat messages (TRL's name)."""
    rejected_key: str = "rejected"
    """Column holding the dispreferred response: text or chat messages (TRL's name)."""
    on_bad_row: str = "error"
    """(posttrain) A bad pair (missing column, empty or equal chosen/rejected, mismatched prompt, too long): error (names file, row and column) or skip (counted by reason and reported)."""
    self_pairs: SelfPairsConfig = field(default_factory=SelfPairsConfig)
    """(posttrain) The pairs a run builds from its model's samples when data.train_files is null (cached: sampled once)."""


@_cfg()
class SFTModelConfig:
    partial_pretrain: str = "~/models/gemma-1.1-7b-it"
    """Model to train: a local HF folder, a hub id, a .gguf file, or smollm2-135m-instruct."""
    fsdp_config: FSDPConfig = field(default_factory=_sft_fsdp)
    """FSDP2 sharding and precision (the RL actor's keys; posttrain computes in fp32 by default here)."""
    external_lib: Optional[str] = None
    """Module to import before loading (registers custom models)."""
    enable_gradient_checkpointing: bool = True
    """Recompute activations in backward to save memory."""
    trust_remote_code: bool = False
    """Allow model code from the checkpoint folder to run."""
    lora_rank: int = 0
    """LoRA rank (0: full fine-tuning)."""
    lora_alpha: int = 16
    """LoRA alpha: the adapter's update is scaled by lora_alpha / lora_rank."""
    target_modules: Any = "all-linear"
    """Layers given adapters: all-linear or a list of module names."""
    exclude_modules: Any = None
    """(posttrain) Modules kept without adapters."""
    lora_adapter_path: Optional[str] = None
    """(posttrain) A peft LoRA adapter folder to start from."""
    use_liger: bool = False
    """Liger kernels (not available: true is refused)."""
    strategy: str = "fsdp2"
    """Sharding strategy: fsdp2 (fsdp is read as fsdp2)."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """(posttrain) Entries that override the model's HF config."""


@_cfg()
class SFTOptimConfig:
    lr: float = 1e-5
    """Learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    lr_warmup_steps_ratio: float = 0.1
    """Warm-up steps as a fraction of the total steps."""
    warmup_steps_ratio: Optional[float] = None
    """Deprecated verl name of lr_warmup_steps_ratio; when set it wins."""
    lr_warmup_steps: int = -1
    """(posttrain) Warm-up steps; -1: use lr_warmup_steps_ratio."""
    clip_grad: float = 1.0
    """Clip the gradient norm to this (0: no clipping)."""
    lr_scheduler: str = "cosine"
    """Schedule after warm-up: cosine or constant."""
    optimizer: str = "auto"
    """(posttrain; TRL's ``optim``) AdamW (float32 moments), posttrain_adamw_8bit (posttrain's 8-bit block-wise
    moments), a library's by transformers' name (adamw_8bit: bitsandbytes; adamw_torch_8bit: torchao), or auto: the
    run's memory plan chooses (posttrain_adamw_8bit on a one-process CPU run)."""
    min_lr_ratio: float = 0.0
    """(posttrain) Cosine floor as a fraction of lr."""
    optimizer_impl: str = "torch.optim"
    """Module of the optimizer class (verl's key: torch.optim, posttrain.optim, torchao.optim, bitsandbytes.optim, ...)."""
    override_optimizer_config: Optional[dict[str, Any]] = None
    """Extra constructor arguments of the optimizer (verl's key)."""


@_cfg()
class SFTCheckpointConfig:
    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """Accepted for verl compatibility: posttrain always saves model, optimizer and loader position."""
    load_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """Accepted for verl compatibility."""


@_cfg()
class SFTTrainerConfig:
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    """Checkpoint folder (global_step_N/actor, as RL runs)."""
    default_hdfs_dir: Optional[str] = None
    """Remote checkpoint copy (not supported)."""
    project_name: str = "gsm8k-sft"
    """Project name for trackers and the checkpoint folder."""
    experiment_name: str = "test"
    """Run name for trackers and the checkpoint folder."""
    total_epochs: int = 4
    """Passes over the training rows."""
    total_training_steps: Optional[int] = None
    """Stop after this many steps (null: total_epochs x steps per epoch)."""
    logger: list[str] = field(default_factory=lambda: ["console", "wandb"])
    """Metric back ends: console, file, tensorboard, wandb, mlflow."""
    seed: int = 1
    """Seed of initialisation and shuffling."""
    save_freq: int = -1
    """Save a checkpoint every this many steps; the last step is always saved and exported as hf_model/ (verl's SFT trainer)."""
    test_freq: int = -1
    """Validation loss every this many steps; the last step is always validated (verl's SFT trainer)."""
    nnodes: int = 1
    """Machines (Ray ranks; under torchrun the launcher's world size wins)."""
    n_gpus_per_node: int = 8
    """Devices (data-parallel ranks) per machine."""
    device: str = "auto"
    """cuda, cpu or auto (cuda when present)."""
    max_ckpt_to_keep: Optional[int] = None
    """Keep only the newest N checkpoints (null: all)."""
    max_consecutive_nonfinite: int = 3
    """(posttrain) Stop (exit code 3) after this many steps in a row whose update had a non-finite loss or gradient."""
    resume_mode: str = "auto"
    """auto (latest checkpoint if any), disable, or resume_path."""
    resume_from_path: Optional[str] = None
    """Checkpoint folder (global_step_N) for resume_mode=resume_path."""
    resume_path: Optional[str] = None
    """Old verl name of resume_from_path (implies resume_mode=resume_path)."""
    checkpoint: SFTCheckpointConfig = field(default_factory=SFTCheckpointConfig)
    """What checkpoints hold."""
    start_over: bool = False
    """(posttrain) Start at step 0 although default_local_dir holds checkpoints (they are moved aside)."""
    run_dir: Optional[str] = None
    """(posttrain) Folder for metrics.jsonl and tracker files (null: outputs/<project>/<experiment>)."""


@_cfg()
class DPOSection:
    beta: float = 0.1
    """Strength of the implicit KL to the reference: rewards are beta x (log pi - log pi_ref) (TRL)."""
    loss_type: str = "sigmoid"
    """sigmoid (DPO), ipo, hinge (SLiC), robust (TRL's DPOTrainer names), or simpo (TRL's CPOTrainer: no reference model)."""
    label_smoothing: float = 0.0
    """Probability that a pair's labels are flipped (conservative DPO / robust / simpo); 0 <= x < 0.5."""
    precompute_ref_log_probs: bool = False
    """Compute the reference log-probs of every pair once before training (no reference model kept)."""
    simpo_gamma: float = SIMPO_GAMMA
    """SimPO's target reward margin: -log sigmoid(beta x (avg log-prob chosen - rejected) - simpo_gamma) (TRL's name)."""
    cpo_alpha: float = CPO_ALPHA
    """Weight of the chosen responses' NLL added to the SimPO loss (TRL's name; 0 is SimPO, TRL's CPO default 1.0)."""

    def objective(self) -> Any:
        """The update objective these knobs ask for (`posttrain.algorithms.objectives`), checked:
        ConfigError naming the ``dpo.*`` key and what is valid."""
        from posttrain.algorithms.dpo import check_dpo_options, check_simpo_options
        from posttrain.algorithms.objectives import DPO, SimPO

        check_dpo_options(beta=self.beta, loss_type=self.loss_type, label_smoothing=self.label_smoothing)
        check_simpo_options(loss_type=self.loss_type, simpo_gamma=self.simpo_gamma, cpo_alpha=self.cpo_alpha,
                            default_gamma=SIMPO_GAMMA, default_alpha=CPO_ALPHA)
        if self.loss_type == "simpo":
            if self.precompute_ref_log_probs:
                raise ConfigError("dpo.precompute_ref_log_probs=true with dpo.loss_type=simpo: SimPO uses no reference "
                                  "log-probs; set it to false")
            return SimPO(beta=self.beta, simpo_gamma=self.simpo_gamma, cpo_alpha=self.cpo_alpha,
                         label_smoothing=self.label_smoothing)
        return DPO(beta=self.beta, loss_type=self.loss_type, label_smoothing=self.label_smoothing)


@_cfg()
class SFTConfig:
    """`python -m posttrain.trainer.fsdp_sft_trainer` / `posttrain sft`: verl's `sft_trainer.yaml`."""

    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    """Training and validation rows."""
    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    """The model trained."""
    optim: SFTOptimConfig = field(default_factory=SFTOptimConfig)
    """AdamW and the lr schedule."""
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
    """The training loop, checkpoints and loggers."""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses sequence parallelism: no effect (each rank keeps whole sequences: the same updates, more memory per rank; said at start-up)."""
    use_remove_padding: bool = False
    """Pack the valid tokens of a micro-batch into one row (no padding computed)."""
    use_prefix_grouper: bool = False
    """(posttrain) Rows sharing a prompt encode it once (DPO's chosen/rejected pairs)."""


@_cfg()
class DPOConfig(SFTConfig):
    """`posttrain dpo` / `posttrain.DPOTrainer`: the SFT tree plus `dpo.*` (TRL's names)."""

    data: DPODataConfig = field(default_factory=DPODataConfig)
    """Preference rows: prompt, chosen, rejected."""
    use_prefix_grouper: bool = True
    """(posttrain) A pair's chosen and rejected rows encode their shared prompt once (exact; on by default for DPO)."""
    dpo: DPOSection = field(default_factory=DPOSection)
    """DPO loss and reference."""

