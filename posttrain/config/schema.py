"""The root of the config tree and the sections `data`, `algorithm`, `trainer`,
`custom_reward_function`, `reward` (posttrain) and `ray_kwargs`.

Every field carries a one-line doc string right under it; `posttrain config --keys` and
`docs/config.md` are generated from them (see `posttrain.config.docs`).
"""

from __future__ import annotations

from dataclasses import field
from typing import Any, Optional

from posttrain.config.actor_rollout_ref import ActorRolloutRefConfig, _cfg
from posttrain.config.async_training import AsyncTrainingConfig
from posttrain.config.critic import CriticConfig, RewardModelConfig
from posttrain.config.distillation import DistillationConfig
from posttrain.config.reward import RewardConfig


@_cfg()
class CustomClsConfig:
    path: Optional[str] = None
    """File defining a custom dataset class."""
    name: Optional[str] = None
    """Name of that class."""


@_cfg()
class ArithmeticTaskConfig:
    digits: int = 2
    """(posttrain) Digits per operand of the built-in arithmetic task (used when data.train_files is null)."""
    ops: list[str] = field(default_factory=lambda: ["+"])
    """(posttrain) Operators of the built-in task: any of +, -, *."""
    n_train: int = 1024
    """(posttrain) Training problems of the built-in task."""
    n_test: int = 128
    """(posttrain) Held-out problems of the built-in task (disjoint from training)."""
    seed: int = 0
    """(posttrain) Seed of the built-in task's problem generator."""
    prompt_style: str = "fewshot"
    """(posttrain) How problems are asked: plain, instruct, fewshot, fewshot_instruct, tool and retry (multi-turn: examples/multiply_tool.yaml, examples/addition_retry.yaml)."""


@_cfg()
class DataConfig:
    tokenizer: Optional[str] = None
    """Tokenizer path (null: the actor model's)."""
    use_shm: bool = False
    """Copy data to shared memory first."""
    train_files: Any = "~/data/rlhf/gsm8k/train.parquet"
    """Training prompts: one parquet/jsonl path or a list of them (null: the built-in arithmetic task)."""
    val_files: Any = "~/data/rlhf/gsm8k/test.parquet"
    """Validation prompts: one path or a list (null: the built-in arithmetic task's test split)."""
    train_max_samples: int = -1
    """Use only the first N training rows (-1: all)."""
    val_max_samples: int = -1
    """Use only the first N validation rows (-1: all)."""
    prompt_key: str = "prompt"
    """Column holding the chat messages."""
    reward_fn_key: str = "data_source"
    """Column that picks the scorer."""
    max_prompt_length: int = 512
    """Longest prompt in tokens (after the chat template)."""
    max_response_length: int = 512
    """Most tokens generated per response."""
    train_batch_size: int = 1024
    """Prompts per training step."""
    gen_batch_size: int = "${data.train_batch_size}"  # type: ignore[assignment]
    """Prompts drawn per generation round with algorithm.filter_groups.enable (verl's DAPO); otherwise it must equal train_batch_size."""
    val_batch_size: Optional[int] = None
    """Prompts per validation batch (null: the whole validation set at once)."""
    return_raw_input_ids: bool = False
    """Also return the unpadded prompt ids."""
    return_raw_chat: bool = False
    """Also return the prompt messages (for engines that template themselves)."""
    return_full_prompt: bool = False
    """Also return the templated prompt text."""
    shuffle: bool = True
    """Shuffle training prompts each epoch."""
    seed: int = 1
    """Seed of the training-prompt shuffle."""
    dataloader_num_workers: int = 8
    """Worker processes of the prompt loader (posttrain tokenises up front, so this is unused)."""
    validation_shuffle: bool = False
    """Shuffle validation prompts."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than max_prompt_length (the count is logged)."""
    filter_overlong_prompts_workers: int = 1
    """Processes used to filter overlong prompts."""
    truncation: str = "error"
    """What to do with an overlong prompt that is kept: error, left, right, middle."""
    trust_remote_code: bool = False
    """Allow tokenizer code from the model folder to run."""
    custom_cls: CustomClsConfig = field(default_factory=CustomClsConfig)
    """Custom dataset class."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for tokenizer.apply_chat_template."""
    tool_config_path: Optional[str] = "${oc.select:actor_rollout_ref.rollout.multi_turn.tool_config_path,null}"
    """Tool YAML whose schemas the chat template renders into every prompt (tools=...), as the rollout offers them; follows multi_turn.tool_config_path."""
    function_tool_path: Optional[str] = "${oc.select:actor_rollout_ref.rollout.multi_turn.function_tool_path,null}"
    """verl's Python file of plain functions offered as tools (follows multi_turn.function_tool_path); not supported yet: must stay null (tools come from tool_config_path)."""
    image_key: str = "images"
    """Column holding a row's images (vision-language data). posttrain trains text models: where the data has this column, the run stops before loading with one line."""
    video_key: str = "videos"
    """Column holding a row's videos (refused where present, as image_key)."""
    audio_key: str = "audios"
    """Column holding a row's audio (refused where present, as image_key)."""
    image_patch_size: int = 14
    """Vision processor's patch size (used only with image data, which is not supported yet)."""
    return_multi_modal_inputs: bool = True
    """Return the processor's multimodal inputs (used only with image/video/audio data)."""
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra arguments of the multimodal processor (used only with image/video/audio data)."""
    arithmetic: ArithmeticTaskConfig = field(default_factory=ArithmeticTaskConfig)
    """(posttrain) The built-in arithmetic task, used where train_files / val_files are null."""


@_cfg()
class CustomRewardFunctionConfig:
    path: Optional[str] = None
    """Python file defining the scoring function (null: built-in scorers by data_source)."""
    name: str = "compute_score"
    """Function name in that file: compute_score(data_source, solution_str, ground_truth, extra_info=None)."""


@_cfg()
class KLControlConfig:
    type: str = "fixed"
    """KL coefficient controller for the in-reward penalty: fixed or adaptive."""
    kl_coef: float = 0.001
    """Initial (or fixed) KL coefficient beta."""
    horizon: int = 10000
    """Adaptive controller horizon (in samples)."""
    target_kl: float = 0.1
    """Adaptive controller target KL."""


@_cfg()
class PFPPOConfig:
    reweight_method: str = "pow"
    """Preference-feedback PPO reweighting: pow, max_min, max_random."""
    weight_pow: float = 2.0
    """Exponent for the pow method."""


@_cfg()
class RolloutCorrectionConfig:
    rollout_is: Optional[str] = None
    """Importance weights min(p_old / p_rollout, threshold) on the policy loss: null (off), token, or sequence (one weight per response)."""
    rollout_is_threshold: float = 2.0
    """Upper truncation of the importance weights."""
    rollout_is_batch_normalize: bool = False
    """Divide the truncated importance weights by their batch mean."""
    rollout_rs: Optional[str] = None
    """Rejection of tokens/responses by divergence: null, or comma-separated token_k1..k3, seq_sum_k1..k3, seq_mean_k1..k3, seq_max_k2/k3."""
    rollout_rs_threshold: Any = None
    """Rejection bounds, one shared or one per rollout_rs option: "lower_upper" ratio bounds (or one number u: 1/u..u) for k1, an upper bound otherwise."""
    bypass_mode: bool = False
    """Use the engine's log-probs as the old log-probs and skip the old-log-prob forward pass."""
    loss_type: str = "ppo_clip"
    """Policy loss in bypass mode: ppo_clip (the configured loss, ratio against the rollout policy); reinforce is not implemented."""


@_cfg()
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: drop prompt groups whose responses all score the same and generate more prompt batches until data.train_batch_size groups remain."""
    metric: Optional[str] = None
    """Per-response value compared within a group (required when enabled): acc or score (fields the reward manager records), seq_reward or seq_final_reward (the response's summed score)."""
    max_num_gen_batches: int = 0
    """Most generation rounds per training step before the run stops with an error (0: no limit of rounds, but a step that has drawn a whole epoch of prompts without filling its batch stops with an error, since more rounds would repeat the same prompts)."""


@_cfg()
class AlgorithmConfig:
    gamma: float = 1.0
    """Discount factor (gae, reinforce_plus_plus)."""
    lam: float = 1.0
    """GAE lambda."""
    adv_estimator: str = "gae"
    """Advantage estimator (posttrain.algorithms): gae, grpo, grpo_vectorized, grpo_passk, gdpo, rloo, rloo_vectorized, opo, gpg, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, optimal_token_baseline, tir_optimal_token_baseline."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO divides by the group's std; false is Dr.GRPO."""
    use_kl_in_reward: bool = False
    """Subtract beta * KL(actor || reference) from token rewards; loads the reference model."""
    kl_penalty: str = "kl"
    """KL estimator for the in-reward penalty: kl/k1, abs, mse/k2, low_var_kl/k3, full."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """In-reward KL coefficient controller."""
    use_pf_ppo: bool = False
    """Preference-feedback PPO reweighting (not supported yet; must stay false)."""
    pf_ppo: PFPPOConfig = field(default_factory=PFPPOConfig)
    """Its settings."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Correction for the rollout engine's policy differing from the trainer's (importance weights, rejection, bypass)."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling (group filtering)."""
    gdpo_reward_keys: Optional[list[str]] = None
    """gdpo (required there): the reward parts (keys of the dict a scoring function returns), each normalised within its group before they are summed."""
    gdpo_reward_weights: Optional[list[float]] = None
    """gdpo: one weight per gdpo_reward_keys part in the sum; null: 1 each."""


@_cfg()
class ColocateAsyncConfig:
    num_warmup_batches: int = 1
    """Batches generated ahead before training starts (posttrain: the in-flight budget of async_training.*)."""


@_cfg()
class HybridRolloutConfig:
    enable_switch: bool = False
    """Lend idle trainer devices to generation (verl's V1 engine only; refused when True)."""
    switch_threshold_ratio: float = 0.4
    """verl's hybrid-rollout switch threshold (no effect here)."""
    adaptive_switch_threshold: bool = True
    """verl's hybrid-rollout switch (no effect here)."""
    switch_threshold_step_up: float = 0.05
    """verl's hybrid-rollout switch (no effect here)."""
    switch_threshold_step_down: float = 0.03
    """verl's hybrid-rollout switch (no effect here)."""
    switch_threshold_release_steps: int = 2
    """verl's hybrid-rollout switch (no effect here)."""
    switch_cost_window_size: int = 3
    """verl's hybrid-rollout switch (no effect here)."""


@_cfg()
class SeparateAsyncConfig:
    num_warmup_batches: int = 1
    """Batches generated ahead before training starts (posttrain: the in-flight budget of async_training.*)."""
    parameter_sync_step: int = 4
    """Trainer updates between two weight pushes to the rollout pool (posttrain's async_training.trigger_parameter_sync_step)."""
    hybrid_rollout: HybridRolloutConfig = field(default_factory=HybridRolloutConfig)
    """Lending trainer devices to generation (verl's V1 engine)."""


@_cfg()
class CustomSamplerConfig:
    path: Optional[str] = None
    """File of a custom replay-buffer sampler (not supported: must stay null)."""
    name: Optional[str] = None
    """Its class."""


@_cfg()
class V1SamplerConfig:
    max_off_policy_threshold: int = 8
    """Most weight versions a sample may lag the trainer in the async modes (posttrain's async_training.staleness_threshold)."""
    max_off_policy_strategy: str = "drop"
    """What happens to a staler sample: drop (wait is verl's V1 engine only)."""
    sync_refill_failed_groups: bool = False
    """Refill groups whose samples failed (verl's V1 engine; no effect here)."""
    custom_sampler: CustomSamplerConfig = field(default_factory=CustomSamplerConfig)
    """A custom replay-buffer sampler."""
    sampler_kwargs: dict[str, Any] = field(default_factory=dict)
    """Its arguments."""


@_cfg()
class TrainerV1Config:
    trainer_mode: str = "sync"
    """sync (generate, then train, on the same devices), colocate_async (posttrain: the one-step-off run, a rollout pool one weight version behind) or separate_async (posttrain: the fully-async run, rollout.nnodes x rollout.n_gpus_per_node rollout workers streaming, weights pushed every parameter_sync_step updates, partial rollouts)."""
    sync: dict[str, Any] = field(default_factory=dict)
    """The sync mode's settings (it has none)."""
    colocate_async: ColocateAsyncConfig = field(default_factory=ColocateAsyncConfig)
    """The colocate_async mode."""
    separate_async: SeparateAsyncConfig = field(default_factory=SeparateAsyncConfig)
    """The separate_async mode."""
    sampler: V1SamplerConfig = field(default_factory=V1SamplerConfig)
    """Staleness control of the async modes."""


@_cfg()
class TrainerConfig:
    balance_batch: bool = True
    """Reorder responses so ranks get equal token counts."""
    total_epochs: int = 30
    """Passes over the training prompts."""
    total_training_steps: Optional[int] = None
    """Stop after this many steps (null: total_epochs x steps per epoch)."""
    project_name: str = "verl_examples"
    """Project name for trackers and the checkpoint folder."""
    experiment_name: str = "gsm8k"
    """Run name for trackers and the checkpoint folder."""
    logger: list[str] = field(default_factory=lambda: ["console", "wandb"])
    """Metric back ends: console, file, tensorboard, wandb, mlflow."""
    log_val_generations: int = 0
    """Validation generations to print each validation."""
    rollout_data_dir: Optional[str] = None
    """Folder to dump training rollouts as JSON lines."""
    validation_data_dir: Optional[str] = None
    """Folder to dump validation generations."""
    nnodes: int = 1
    """Machines."""
    n_gpus_per_node: int = 8
    """Devices (data-parallel ranks) per machine."""
    save_freq: int = -1
    """Save a checkpoint every this many steps (-1: never)."""
    export_at_end: bool = False
    """(posttrain) A finished run writes its final actor to hf_model/ in default_local_dir even when save_freq keeps no checkpoint (the built-in run sets it)."""
    esi_redundant_time: int = 0
    """Seconds reserved before an expiring job to save."""
    resume_mode: str = "auto"
    """auto (latest checkpoint if any), disable, or resume_path."""
    resume_from_path: Optional[str] = None
    """Checkpoint folder (global_step_N) for resume_mode=resume_path."""
    val_before_train: bool = True
    """Validate before the first step."""
    val_only: bool = False
    """Validate and stop."""
    test_freq: int = -1
    """Validate every this many steps (-1: never)."""
    critic_warmup: int = 0
    """Steps that update only the critic."""
    default_hdfs_dir: Optional[str] = None
    """Remote checkpoint copy (not supported)."""
    del_local_ckpt_after_load: bool = False
    """Delete a local checkpoint once loaded."""
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    """Checkpoint folder."""
    max_actor_ckpt_to_keep: Optional[int] = None
    """Keep only the newest N actor checkpoints (null: all)."""
    max_critic_ckpt_to_keep: Optional[int] = None
    """Keep only the newest N critic checkpoints (null: all)."""
    ray_wait_register_center_timeout: int = 300
    """Seconds to wait for Ray workers to register (> 0)."""
    device: str = "auto"
    """cuda, cpu or auto (cuda when present). verl's default is cuda."""
    use_legacy_worker_impl: str = "auto"
    """verl worker implementation switch (accepted; posttrain has one implementation)."""
    seed: int = 1
    """(posttrain) Seed of model sampling and initialisation."""
    max_consecutive_nonfinite: int = 3
    """(posttrain) Stop after this many steps in a row whose update had a non-finite loss or gradient."""
    run_dir: Optional[str] = None
    """(posttrain) Folder for metrics.jsonl, plots and tracker files (null: outputs/<project>/<experiment>)."""
    use_v1: bool = True
    """verl's trainer generation (verl 0.9's default: V1). Here it selects trainer.v1.trainer_mode; False is verl's older trainer, which posttrain runs as the sync mode."""
    v1: TrainerV1Config = field(default_factory=lambda: TrainerV1Config())
    """verl 0.9's trainer modes (with use_v1=True)."""
    start_over: bool = False
    """(posttrain) Start at step 0 although trainer.default_local_dir holds checkpoints: they are moved to previous_run_<time>/ inside it first (never deleted, never mixed with this run's)."""


@_cfg()
class RayInitConfig:
    num_cpus: Optional[int] = None
    """CPUs Ray may use."""
    runtime_env: dict[str, Any] = field(default_factory=lambda: {"py_executable": None})
    """Ray's runtime_env, passed to ray.init (env_vars, working_dir, pip, ...). py_executable: the interpreter (or a command prefix such as `uv run ...`) Ray starts workers with; null: this interpreter."""


@_cfg()
class RayKwargsConfig:
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    """ray.init arguments."""
    timeline_json_file: Optional[str] = None
    """Write a Ray timeline here."""


@_cfg()
class PostTrainConfig:
    """The whole run: verl's `ppo_trainer.yaml` tree plus a few posttrain keys."""

    data: DataConfig = field(default_factory=DataConfig)
    """Prompt data."""
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    """Policy, rollout and reference."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value function (PPO with GAE)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Learned reward model."""
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    """User scoring function."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward loop (verl 0.9): the scoring function, its manager, a reward model or judge, the sandbox, and posttrain's scorer limits."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimation and in-reward KL."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The training loop."""
    ray_kwargs: RayKwargsConfig = field(default_factory=RayKwargsConfig)
    """Ray settings."""
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    """Asynchronous rollouts (verl's one-step-off and fully-async keys), with actor_rollout_ref.hybrid_engine=False."""
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """On-policy distillation: frozen teachers score the student's sampled tokens (verl's distillation.* keys)."""
    no_effect: list[str] = field(default_factory=list)
    """(posttrain; filled by the loader) verl keys this run sets that have no effect here, as key=value: listed once at start-up and by `posttrain plan`, each with its reason (posttrain.config.verl_keys)."""
