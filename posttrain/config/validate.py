"""Config checks that run before any model loads.

`find_problems` returns every error and warning at once (`posttrain plan` prints them all);
`validate_config` raises one ConfigError listing every error. Each message names the full
dotted key and what would be valid.
"""

from __future__ import annotations

from typing import Any, Collection, Iterable

from posttrain.config.actor_rollout_ref import HOST_MEMORY_MODES, HOST_PAGING_MODES
from posttrain.config.async_training import V1_MODES, async_enabled, async_problems, async_warnings
from posttrain.config.dapo import dapo_problems, dapo_warnings
from posttrain.config.derived import SizeError, derive_sizes, estimator_needs, uses_critic
from posttrain.config.distillation import distillation_problems, distillation_warnings
from posttrain.errors import ConfigError
from posttrain.config.ranges import get_key
from posttrain.config.reward_tree import reward_tree_problems
from posttrain.config.schema import PostTrainConfig

ROLLOUT_ENGINES = ("hf", "vllm", "sglang")
TRUNCATIONS = ("error", "left", "right", "middle")
LOGGERS = ("console", "file", "tensorboard", "wandb", "mlflow")
RESUME_MODES = ("auto", "disable", "resume_path")
SCHEDULERS = ("constant", "cosine")
DTYPES = ("bf16", "fp16", "fp32", "bfloat16", "float16", "float32")
DEVICES = ("auto", "cpu", "cuda")
ASYNC_KEYS = ("async_training.staleness_threshold", "async_training.trigger_parameter_sync_step",
              "async_training.require_batches", "actor_rollout_ref.rollout.nnodes",
              "actor_rollout_ref.rollout.n_gpus_per_node", "actor_rollout_ref.rollout.total_rollout_steps")
"""Checked by posttrain.config.async_training (0 rollout devices is valid with the hybrid engine)."""


def _choices() -> dict[str, tuple[str, ...]]:
    from posttrain.algorithms import LOSS_AGG_MODES, KL_PENALTY_TYPES, registered_adv_estimators, registered_policy_losses

    return {
        "algorithm.adv_estimator": registered_adv_estimators(),
        "algorithm.kl_penalty": KL_PENALTY_TYPES,
        "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
        "actor_rollout_ref.actor.kl_loss_type": KL_PENALTY_TYPES,
        "actor_rollout_ref.actor.loss_agg_mode": LOSS_AGG_MODES,
        "actor_rollout_ref.actor.policy_loss.loss_mode": registered_policy_losses(),
        "actor_rollout_ref.actor.optim.lr_scheduler_type": SCHEDULERS,
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype": (*DTYPES, "auto"),
        "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype": (*DTYPES, "auto"),
        "critic.model.fsdp_config.mixed_precision.param_dtype": (*DTYPES, "auto"),
        "reward_model.model.fsdp_config.mixed_precision.param_dtype": (*DTYPES, "auto"),
        "reward_model.combine": ("replace", "sum"),
        "actor_rollout_ref.actor.fsdp_config.model_dtype": DTYPES,
        "actor_rollout_ref.actor.fsdp_config.host_memory": HOST_MEMORY_MODES,
        "critic.model.fsdp_config.host_memory": HOST_MEMORY_MODES,  # the actor's is the process's: _check_conflicts
        "actor_rollout_ref.actor.fsdp_config.host_paging": HOST_PAGING_MODES,
        "actor_rollout_ref.ref.fsdp_config.host_paging": HOST_PAGING_MODES,
        "critic.model.fsdp_config.host_paging": HOST_PAGING_MODES,
        "reward_model.model.fsdp_config.host_paging": HOST_PAGING_MODES,
        "actor_rollout_ref.actor.strategy": ("fsdp", "fsdp2"),
        "actor_rollout_ref.ref.strategy": ("fsdp", "fsdp2"),
        "critic.strategy": ("fsdp", "fsdp2"),
        "trainer.v1.trainer_mode": V1_MODES,
        "trainer.v1.sampler.max_off_policy_strategy": ("drop",),
        "actor_rollout_ref.rollout.name": ROLLOUT_ENGINES,
        "critic.loss_agg_mode": LOSS_AGG_MODES,
        "critic.optim.lr_scheduler_type": SCHEDULERS,
        "data.truncation": TRUNCATIONS,
        "reward.on_error": ("raise", "zero"),
        "reward_model.reward_manager": ("naive", "dapo"),
        "actor_rollout_ref.rollout.multi_turn.format": ("hermes",),
        "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": ("left", "right", "middle"),
        "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode": ("disable", "strict", "ignore_strippable"),
        "actor_rollout_ref.rollout.agent.default_agent_loop": ("tool_agent", "single_turn_agent"),
    }


def _check_choices(config: PostTrainConfig) -> Iterable[str]:
    from posttrain.config.verl_keys import backend_refusal

    for key, valid in _choices().items():
        value = get_key(config, key)
        if value not in valid:
            yield backend_refusal(key, value) or f"{key}={value!r} is not one of: {', '.join(valid)}"
    for key in ("actor_rollout_ref.actor.optim.warmup_style", "critic.optim.warmup_style"):
        value = get_key(config, key)
        if value is not None and value not in SCHEDULERS:
            yield f"{key}={value!r} is not one of: {', '.join(SCHEDULERS)}"
    yield from trainer_problems(config.trainer)


def trainer_problems(trainer: Any) -> list[str]:
    """The ``trainer.*`` keys every tree shares (RL, SFT, DPO): resume mode, device, the logger's back
    ends, and the counts of epochs, steps and ranks."""
    from posttrain.config.verl_keys import backend_refusal

    out = [backend_refusal(f"trainer.{key}", getattr(trainer, key))
           or f"trainer.{key}={getattr(trainer, key)!r} is not one of: {', '.join(valid)}"
           for key, valid in (("resume_mode", RESUME_MODES), ("device", DEVICES)) if getattr(trainer, key) not in valid]
    out += [f"trainer.logger contains {name!r}; valid back ends: {', '.join(LOGGERS)}"
            for name in trainer.logger if name not in LOGGERS]
    for key in TRAINER_COUNTS:
        value = getattr(trainer, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            out.append(f"trainer.{key}={value!r} must be >= 1")
    return out


TRAINER_COUNTS = ("total_epochs", "total_training_steps", "nnodes", "n_gpus_per_node")  # null steps: from the epochs


def _check_ranges(config: PostTrainConfig) -> Iterable[str]:
    arr = config.actor_rollout_ref
    checks = [
        ("actor_rollout_ref.rollout.n", arr.rollout.n >= 1, "must be >= 1"),
        ("actor_rollout_ref.rollout.temperature", arr.rollout.temperature >= 0, "must be >= 0"),
        ("actor_rollout_ref.rollout.top_p", 0 < arr.rollout.top_p <= 1, "must be in (0, 1]"),
        ("actor_rollout_ref.actor.clip_ratio_c", arr.actor.clip_ratio_c > 1, "must be > 1 (dual-clip lower bound)"),
        ("actor_rollout_ref.actor.ppo_epochs", arr.actor.ppo_epochs >= 1, "must be >= 1"),
        ("actor_rollout_ref.actor.optim.lr", arr.actor.optim.lr >= 0, "must be >= 0"),
        ("algorithm.gamma", 0 <= config.algorithm.gamma <= 1, "must be in [0, 1]"),
        ("algorithm.lam", 0 <= config.algorithm.lam <= 1, "must be in [0, 1]"),
        ("data.train_batch_size", config.data.train_batch_size >= 1, "must be >= 1"),
        ("data.max_prompt_length", config.data.max_prompt_length >= 1, "must be >= 1"),
        ("data.max_response_length", config.data.max_response_length >= 1, "must be >= 1"),
        ("algorithm.filter_groups.max_num_gen_batches", config.algorithm.filter_groups.max_num_gen_batches >= 0,
         "must be >= 0 (0: no limit on generation rounds per step)"),
    ]
    for key, ok, rule in checks:
        if not ok:
            yield f"{key}={get_key(config, key)!r} {rule}"


ULYSSES_KEYS = ("actor_rollout_ref.actor.ulysses_sequence_parallel_size",
                "actor_rollout_ref.ref.ulysses_sequence_parallel_size", "critic.ulysses_sequence_parallel_size",
                "reward_model.ulysses_sequence_parallel_size")


ULYSSES_NOTE = ("no effect here: Ulysses sequence parallelism splits each sequence over ranks to save activation "
                "memory; posttrain keeps whole sequences on each rank (the same updates, more memory per rank)")


def _follows_actor(config: PostTrainConfig, key: str) -> bool:
    """The reference's sequence-parallel size that merely follows the actor's (one note, not two)."""
    return key.startswith("actor_rollout_ref.ref.") and get_key(config, key) == get_key(config, ULYSSES_KEYS[0])


def _check_unsupported(config: PostTrainConfig) -> Iterable[str]:
    """Settings verl accepts that posttrain does not implement yet: refused, never ignored."""
    unsupported = [
        ("trainer.v1.separate_async.hybrid_rollout.enable_switch", True, "lending idle trainer devices to "
         "generation needs verl's V1 separate_async engine"),
        ("algorithm.use_pf_ppo", True, "PF-PPO reweighting is not supported yet"),
        ("actor_rollout_ref.actor.checkpoint.async_save", True, "asynchronous checkpoint saving is not supported yet"),
    ]
    for key in ("trainer.v1.sampler.custom_sampler.path", "actor_rollout_ref.rollout.multi_turn.function_tool_path"):
        if get_key(config, key) is not None:
            yield (f"{key}={get_key(config, key)!r}: not supported yet; set it to null"
                   + (" (tools come from multi_turn.tool_config_path)" if "tool" in key else ""))
    if config.actor_rollout_ref.rollout.agent.agent_loop_config_path is not None:
        yield ("actor_rollout_ref.rollout.agent.agent_loop_config_path: custom agent loops are not supported yet; "
               "set it to null (the built-in tool_agent and single_turn_agent loops need no file)")
    for key, bad, why in unsupported:
        if get_key(config, key) == bad:
            yield f"{key}={bad}: {why}; set it to {not bad}"
    rollout = config.actor_rollout_ref.rollout
    if rollout.seed_per_batch and rollout.name != "hf":
        yield (f"actor_rollout_ref.rollout.seed_per_batch=True with actor_rollout_ref.rollout.name={rollout.name}: "
               "per-batch sampling seeds are implemented for the hf engine only; set rollout.name=hf or "
               "seed_per_batch=False")
    if rollout.over_sample_rate:
        yield "actor_rollout_ref.rollout.over_sample_rate: over-sampling is not supported yet; set it to 0"
    world = config.trainer.nnodes * config.trainer.n_gpus_per_node
    compiled = [k for k, used in (("actor_rollout_ref.model.compile_layers", True),
                                  ("critic.model.compile_layers", uses_critic(config))) if used and get_key(config, k)]
    if world > 1 and compiled:
        yield (f"{compiled[0]}=True: compiled decoder layers are not supported on FSDP2 ranks yet ({world} ranks = "
               "trainer.nnodes x trainer.n_gpus_per_node); set it to False or run on one rank")


def _check_conflicts(config: PostTrainConfig) -> Iterable[str]:
    algo, arr = config.algorithm, config.actor_rollout_ref
    if estimator_needs(algo.adv_estimator, "needs_critic") and config.critic.enable is False:
        yield (f"algorithm.adv_estimator={algo.adv_estimator} needs a learned critic, but critic.enable=False; "
               "enable the critic or pick a critic-free estimator (grpo, rloo, reinforce_plus_plus, ...)")
    distill = config.distillation
    distillation_only = distill.enabled and not distill.distillation_loss.use_task_rewards  # no task advantage used
    if estimator_needs(algo.adv_estimator, "needs_groups") and arr.rollout.n < 2 and not distillation_only:
        yield (f"algorithm.adv_estimator={algo.adv_estimator} compares responses to the same prompt, but "
               f"actor_rollout_ref.rollout.n={arr.rollout.n} gives groups of one; set rollout.n >= 2 "
               "or use reinforce_plus_plus / gae")
    if arr.actor.use_prefix_grouper and arr.model.use_remove_padding:
        yield ("actor_rollout_ref.actor.use_prefix_grouper=True and actor_rollout_ref.model.use_remove_padding=True "
               "are two layouts of the same forward (prompts encoded once per group, or all rows packed into one); "
               "set one of them to False")
    yield from _check_policy_loss_keys(config)
    yield from _check_estimator_inputs(config)
    yield from _check_reward_model_sizes(config)
    critic_memory, actor_memory = config.critic.model.fsdp_config.host_memory, arr.actor.fsdp_config.host_memory
    if uses_critic(config) and critic_memory not in ("auto", actor_memory):
        yield (f"critic.model.fsdp_config.host_memory={critic_memory}: the freed-memory policy is one for the whole "
               f"process, set by actor_rollout_ref.actor.fsdp_config.host_memory (now {actor_memory}); set it there "
               "and leave the critic's at auto")
    if config.trainer.resume_mode == "resume_path" and not config.trainer.resume_from_path:
        yield "trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N folder)"
    if arr.rollout.temperature == 0 and arr.rollout.do_sample:
        yield ("actor_rollout_ref.rollout.temperature=0 with do_sample=True: sampling needs a positive temperature; "
               "set temperature > 0 or do_sample=False")
    try:
        derive_sizes(config)
    except SizeError as err:
        yield str(err)


def _check_estimator_inputs(config: PostTrainConfig) -> Iterable[str]:
    """What an estimator declares it reads beyond the rewards (`EstimatorSpec`): the sum of pi^2 from the
    old-log-prob pass (optimal_token_baseline), the scoring function's reward parts (gdpo)."""
    algo, actor = config.algorithm, config.actor_rollout_ref.actor
    name = f"algorithm.adv_estimator={algo.adv_estimator}"
    if estimator_needs(algo.adv_estimator, "needs_sum_pi_squared"):
        if not actor.calculate_sum_pi_squared:
            yield (f"{name} needs each token's sum of pi^2 over the vocabulary from the old-log-prob pass; set "
                   "actor_rollout_ref.actor.calculate_sum_pi_squared=True")
        if algo.rollout_correction.bypass_mode:
            yield (f"{name} needs the old-log-prob pass (its sum of pi^2), which "
                   "algorithm.rollout_correction.bypass_mode=True skips; set bypass_mode=False")
        elif async_enabled(config) and not config.async_training.compute_prox_log_prob:
            yield (f"{name} needs the old-log-prob pass (its sum of pi^2), which an asynchronous run "
                   "(actor_rollout_ref.hybrid_engine=False) makes only with async_training.compute_prox_log_prob=True")
    if estimator_needs(algo.adv_estimator, "needs_reward_parts"):
        keys, weights = algo.gdpo_reward_keys, algo.gdpo_reward_weights
        if not keys:
            yield (f"{name} needs algorithm.gdpo_reward_keys: the keys of the dict your scoring function returns, "
                   "one per reward part (e.g. [format_reward,accuracy_reward])")
        elif weights is not None and len(weights) != len(keys):
            yield (f"algorithm.gdpo_reward_weights has {len(weights)} weights for {len(keys)} "
                   f"algorithm.gdpo_reward_keys; give one weight per key, or null for 1 each")


def _check_reward_model_sizes(config: PostTrainConfig) -> Iterable[str]:
    """verl's rule for the reward model's micro-batch: exactly one of the two keys unless dynamic."""
    rm = config.reward_model
    if not rm.enable:
        return
    world = config.trainer.nnodes * config.trainer.n_gpus_per_node
    if rm.micro_batch_size is not None and rm.micro_batch_size_per_gpu is not None:
        yield (f"reward_model.micro_batch_size={rm.micro_batch_size} and reward_model.micro_batch_size_per_gpu="
               f"{rm.micro_batch_size_per_gpu} are both set; set only micro_batch_size_per_gpu (the other is deprecated)")
    elif rm.micro_batch_size is not None and rm.micro_batch_size // world == 0:
        yield f"reward_model.micro_batch_size={rm.micro_batch_size} / {world} ranks = 0 per rank; raise it to at least {world}"
    elif rm.micro_batch_size is None and rm.micro_batch_size_per_gpu is None and not rm.use_dynamic_bsz:
        yield ("reward_model.enable=True needs reward_model.micro_batch_size_per_gpu (responses per reward-model forward "
               "pass on one rank), or reward_model.use_dynamic_bsz=True")


def _check_policy_loss_keys(config: PostTrainConfig) -> Iterable[str]:
    """A registered policy loss declares the actor keys it reads; one this config lacks is refused
    here instead of failing at the first update."""
    from posttrain.algorithms import policy_loss_spec
    from posttrain.config.docs import all_keys

    mode = config.actor_rollout_ref.actor.policy_loss.loss_mode
    try:
        spec = policy_loss_spec(mode)
    except ValueError:
        return  # the choices check names the valid modes
    missing = [f"actor_rollout_ref.actor.{k}" for k in spec.keys if f"actor_rollout_ref.actor.{k}" not in all_keys()]
    if missing:
        yield (f"actor_rollout_ref.actor.policy_loss.loss_mode={mode} reads {', '.join(missing)}, which posttrain's "
               "config does not have yet; pick another loss mode (" + ", ".join(
                   m for m in _loss_modes_with_keys()) + ")")
    for key in (f"actor_rollout_ref.actor.{k}" for k in spec.positive if f"actor_rollout_ref.actor.{k}" in all_keys()):
        if get_key(config, key) is None or not get_key(config, key) > 0:
            yield f"actor_rollout_ref.actor.policy_loss.loss_mode={mode} needs {key} > 0, got {get_key(config, key)}"


def _loss_modes_with_keys() -> list[str]:
    from posttrain.algorithms import policy_loss_spec, registered_policy_losses
    from posttrain.config.docs import all_keys

    return [m for m in registered_policy_losses()
            if all(f"actor_rollout_ref.actor.{k}" in all_keys() for k in policy_loss_spec(m).keys)]


def find_warnings(config: PostTrainConfig, set_keys: Collection[str] | None = None) -> list[str]:
    """Legal but suspicious settings. ``set_keys``: the keys the user set (`posttrain.config.scripts.explicit_keys`),
    so a key a base config sets (the built-in run's critic keys, there for adv_estimator=gae) is not blamed on
    them; None: judged from the values alone."""
    algo, arr = config.algorithm, config.actor_rollout_ref
    warnings = [f"{key}={get_key(config, key)}: {ULYSSES_NOTE}" for key in ULYSSES_KEYS
                if (get_key(config, key) or 1) > 1 and not _follows_actor(config, key)]
    if algo.use_kl_in_reward and arr.actor.use_kl_loss:
        warnings.append("KL is used twice: algorithm.use_kl_in_reward=True and actor_rollout_ref.actor.use_kl_loss=True")
    if arr.actor.entropy_coeff and estimator_needs(algo.adv_estimator, "needs_groups"):
        warnings.append(f"actor_rollout_ref.actor.entropy_coeff={arr.actor.entropy_coeff} with {algo.adv_estimator}: "
                        "GRPO-style scripts usually set it to 0; an entropy bonus can destabilise them")
    if not arr.rollout.do_sample and arr.rollout.n > 1:
        warnings.append(f"actor_rollout_ref.rollout.do_sample=False with n={arr.rollout.n}: greedy samples are identical, "
                        "so group advantages are all zero")
    critic_free = not estimator_needs(algo.adv_estimator, "needs_critic")
    if uses_critic(config) and critic_free:
        warnings.append(f"critic.enable=True but algorithm.adv_estimator={algo.adv_estimator} ignores values: the critic is trained for nothing")
    critic_keys = _critic_keys_set(config, set_keys)
    if config.critic.enable is None and critic_free and critic_keys:
        warnings.append(f"{', '.join(critic_keys)} {'is' if len(critic_keys) == 1 else 'are'} set but no critic is "
                        f"used (adv_estimator={algo.adv_estimator} is critic-free)")
    return warnings


def _critic_keys_set(config: PostTrainConfig, set_keys: Collection[str] | None) -> list[str]:
    """The critic.* keys the user set; without ``set_keys``, verl's critic micro-batch size when it has a value
    (verl's defaults leave it null)."""
    if set_keys is not None:
        return sorted(k for k in set_keys if k.startswith("critic."))
    key = "critic.ppo_micro_batch_size_per_gpu"
    return [key] if get_key(config, key) is not None else []


def _check_lora(config: PostTrainConfig) -> Iterable[str]:
    """LoRA keys (verl's): alpha > 0 when a role uses LoRA, module names as strings, an adapter folder
    that peft wrote. Names that match no module are checked against the model when it loads."""
    for section in ("actor_rollout_ref.model", "critic.model"):
        model = get_key(config, section)
        path = getattr(model, "lora_adapter_path", None)
        if model.lora_rank <= 0 and not path:
            continue
        if not model.lora_alpha > 0:
            yield f"{section}.lora_alpha={model.lora_alpha!r} must be > 0 (the adapter is scaled by lora_alpha / lora_rank)"
        for key in ("target_modules", "exclude_modules"):
            value = getattr(model, key, None)
            names = [value] if isinstance(value, str) else value
            if (value is None and key == "exclude_modules") or (
                    isinstance(names, (list, tuple)) and names and all(isinstance(n, str) and n for n in names)):
                continue
            yield (f"{section}.{key}={value!r} must be all-linear, a list of module names such as [q_proj, v_proj], "
                   "or a regex on full module names")
        if path:
            from posttrain.peft_folder import adapter_folder_problem

            problem = adapter_folder_problem(path)
            if problem:
                yield f"{section}.lora_adapter_path={path}: {problem}"


def find_problems(config: PostTrainConfig, set_keys: Collection[str] | None = None) -> tuple[list[str], list[str]]:
    """(errors, warnings) of a loaded config; ``set_keys``: the keys the user set (`find_warnings`)."""
    from posttrain.config.ranges import RL_RANGES, named_keys, numeric_problems

    errors: list[str] = []
    for check in (_check_choices, _check_ranges, _check_unsupported, dapo_problems, _check_lora, async_problems,
                  distillation_problems, reward_tree_problems):
        errors.extend(check(config))
    # every number the checks above did not name (NaN and inf slip past their comparisons): its declared range
    errors += numeric_problems(config, PostTrainConfig, RL_RANGES, skip=named_keys(errors) | set(ASYNC_KEYS))
    if not errors:  # size arithmetic is only meaningful once values are individually valid
        errors.extend(_check_conflicts(config))
    from posttrain.config.verl_keys import no_effect_lines

    noted = no_effect_lines(list(config.no_effect))
    return errors, find_warnings(config, set_keys) + dapo_warnings(config) + async_warnings(config) + noted + distillation_warnings(config)


def validate_config(config: PostTrainConfig) -> None:
    errors, _ = find_problems(config)
    if errors:
        if len(errors) == 1:
            raise ConfigError(errors[0])
        raise ConfigError(f"{len(errors)} config problems:\n" + "\n".join(f"  - {e}" for e in errors))


def __getattr__(name: str):
    if name == "GROUP_ESTIMATORS":  # kept for importers: a live view of the registry
        from posttrain.algorithms import EstimatorsWith

        return EstimatorsWith("needs_groups")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
