"""Build a run's parts from its config: device, tokenizer, datasets, workers, reward function.

Each builder is a plain function so that tests and recipes can replace one part (a tiny model,
a custom reward) without touching the others.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from posttrain.config import ConfigError, PostTrainConfig
from posttrain.config.roles import RoleSpecs
from posttrain.data import RLHFDataset, build_train_loader, build_val_loader
from posttrain.data.arithmetic import default_dataset_files


def resolve_device(config: PostTrainConfig) -> torch.device:
    """Where this process computes. With several ranks the driver holds no model (the ranks check
    their own devices through Ray), so it stays on CPU: a GPU-less head node is fine."""
    if world_size(config) > 1:
        return torch.device("cpu")
    want = config.trainer.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


def world_size(config: PostTrainConfig) -> int:
    """Ranks of the run: ``trainer.nnodes * trainer.n_gpus_per_node`` (one process per device)."""
    return config.trainer.nnodes * config.trainer.n_gpus_per_node


def check_in_memory_models(config: PostTrainConfig, actor_module: Any, critic_module: Any) -> None:
    if world_size(config) > 1 and (actor_module is not None or critic_module is not None):
        raise ConfigError(
            f"in-memory models can only train in one process, and this run has trainer.nnodes x "
            f"trainer.n_gpus_per_node = {world_size(config)} ranks: save the model to a folder and set "
            "actor_rollout_ref.model.path (and critic.model.path), or set trainer.n_gpus_per_node=1 trainer.nnodes=1")


def check_rollout_engine(config: PostTrainConfig) -> None:
    """Fail at start-up, not mid-run, when the named engine or ``algorithm.rollout_correction`` cannot run."""
    from posttrain.algorithms.rollout_correction import check_rollout_correction_config
    from posttrain.rollout import ROLLOUT_ENGINES
    from posttrain.rollout.engines import SGLANG_MISSING

    rollout = config.actor_rollout_ref.rollout
    if rollout.name not in ROLLOUT_ENGINES:
        raise ConfigError(f"actor_rollout_ref.rollout.name={rollout.name!r}; valid: {', '.join(ROLLOUT_ENGINES)}")
    if rollout.name == "sglang":
        raise ConfigError(SGLANG_MISSING)
    if rollout.name == "vllm":
        from posttrain.rollout.vllm_engine import check_single_replica, import_vllm

        try:
            check_single_replica(dict(rollout.engine_kwargs.vllm or {}))
        except ValueError as err:
            raise ConfigError(str(err)) from None
        try:
            import_vllm()
        except RuntimeError as err:
            raise ConfigError(str(err)) from None
        tp = rollout.tensor_model_parallel_size
        if tp != 1:
            print(f"note: actor_rollout_ref.rollout.tensor_model_parallel_size={tp} requested; this build runs each "
                  "vllm engine with TP 1 on its own rank (one full copy of the weights per rank), so the key is not "
                  "applied", flush=True)
    try:
        check_rollout_correction_config(config.algorithm.rollout_correction, bool(rollout.calculate_log_probs))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def data_files(config: PostTrainConfig) -> tuple[Any, Any]:
    """(train, val) files; null means the built-in arithmetic task (written once into a cache)."""
    train, val = config.data.train_files, config.data.val_files
    if train is None or val is None:
        a = config.data.arithmetic
        builtin_train, builtin_val = default_dataset_files(
            digits=a.digits, ops=tuple(a.ops), n_train=a.n_train, n_test=a.n_test, seed=a.seed,
            prompt_style=a.prompt_style)
        train = builtin_train if train is None else train
        val = builtin_val if val is None else val
    return _expand(train), _expand(val)


def _expand(files: Any) -> Any:
    if isinstance(files, (list, tuple)):
        return [os.path.expanduser(str(f)) for f in files]
    return os.path.expanduser(str(files))


@dataclass
class Data:
    train: RLHFDataset
    val: RLHFDataset
    train_loader: Any
    val_loader: Any


def build_data(config: PostTrainConfig, tokenizer) -> Data:
    train_files, val_files = data_files(config)
    rm = config.reward_model
    keep_chat = rm.enable and rm.model.input_tokenizer is not None  # the reward model re-renders each prompt's chat
    train = RLHFDataset(train_files, tokenizer, replace(config.data, return_raw_chat=True) if keep_chat else config.data)
    val = RLHFDataset(val_files, tokenizer, config.data)
    # The loader yields one generation round's prompts: data.gen_batch_size (verl's DAPO trainer), which
    # equals data.train_batch_size unless algorithm.filter_groups is on.
    key, drawn = ("data.gen_batch_size", config.data.gen_batch_size) if config.algorithm.filter_groups.enable else (
        "data.train_batch_size", config.data.train_batch_size)
    if len(train) < drawn:
        raise ConfigError(f"{key}={drawn} is larger than the {len(train)} usable training prompts in {train_files}; "
                          f"lower {key}")
    loader = build_train_loader(train, replace(config.data, train_batch_size=drawn))
    return Data(train, val, loader, build_val_loader(val, config.data))


def build_reward_fn(config: PostTrainConfig, tokenizer) -> Callable:
    """The classic `RewardManager`, or verl 0.9's reward loop where the reward tree asks for it (a served
    judge, a manager other than naive/dapo, an async function: `posttrain.trainer.reward_loop`)."""
    from posttrain.config.reward_tree import reward_settings
    from posttrain.rewards import RewardManager, load_custom_reward_fn
    from posttrain.trainer import reward_loop

    if reward_loop.wants_reward_loop(config):
        return reward_loop.build_reward_loop(config, tokenizer, device=resolve_device(config).type)
    crf = reward_settings(config)  # custom_reward_function.* or reward.custom_reward_function.*
    compute_score = load_custom_reward_fn(crf.function_path, crf.function_name) if crf.function_path else None
    return RewardManager(tokenizer, compute_score=compute_score, reward_fn_key=config.data.reward_fn_key,
                         num_workers=config.reward.num_workers, on_error=config.reward.on_error,
                         timeout_s=config.reward.timeout_s, **dapo_reward_options(config))


def dapo_reward_options(config: PostTrainConfig) -> dict[str, Any]:
    """What ``reward_model.reward_manager=dapo`` adds to the reward manager (verl's DAPORewardManager):
    plain-number scores recorded as ``acc``, and the overlong buffer when enabled."""
    from posttrain.config.dapo import overlong_settings
    from posttrain.rewards.manager import OverlongBuffer

    from posttrain.config.reward_tree import reward_settings

    if reward_settings(config).manager_name != "dapo":  # reward_model.reward_manager or reward.reward_manager.name
        return {}
    s = overlong_settings(config)  # reward_model.overlong_buffer or reward_model.reward_kwargs.overlong_buffer_cfg
    overlong = OverlongBuffer(s.length, float(s.penalty_factor), s.max_len, s.log) if s.enable else None
    return {"record_acc": True, "overlong": overlong}


def build_workers(config: PostTrainConfig, specs: RoleSpecs, device: torch.device, seed: int,
                  actor_module: Any = None, critic_module: Any = None, tokenizer: Any = None):
    """The worker group: the roles in this process (`LocalWorkerGroup`) for one rank, else one Ray
    actor per device (`RankWorkerGroup`, FSDP2-sharded models).

    ``config``: the run's ``trainer.*`` and ``ray_kwargs.*``; ``specs``: its roles, with per-rank batch
    sizes (`posttrain.config.roles`: from `posttrain.config.worker_config`, or from the SFT tree).
    """
    if world_size(config) == 1:
        return build_local_group(specs, device, seed, actor_module, critic_module, tokenizer)
    from posttrain.distributed.rank_group import RankWorkerGroup

    return RankWorkerGroup(config, specs, seed, tokenizer)


def build_local_group(specs: RoleSpecs, device: torch.device, seed: int, actor_module: Any = None,
                      critic_module: Any = None, tokenizer: Any = None):
    """Every role in ``specs`` in this process (`posttrain.workers.build.build_roles`), placed by
    `posttrain.distributed.placement.InProcess` on ``device`` with the host levers the roles' config sets
    (`HostLevers`: ``host_paging``, ``host_memory``), which settles the process once the roles are built and
    which the group also asks for each call's residency. Batch sizes in ``specs`` are per rank."""
    from posttrain.distributed.placement import HostLevers, InProcess
    from posttrain.workers.build import build_roles
    from posttrain.workers.group import LocalWorkerGroup

    placement = InProcess(device, HostLevers.of(specs))
    roles = build_roles(specs, placement, seed, tokenizer=tokenizer, actor_module=actor_module,
                        critic_module=critic_module)
    placement.settle(roles)
    return LocalWorkerGroup(roles.actor, roles.ref, roles.critic, roles.rm, seed=seed, placement=placement,
                            teachers=roles.teachers)


def run_dir(config: PostTrainConfig) -> Path:
    if config.trainer.run_dir:
        return Path(config.trainer.run_dir).expanduser()
    return Path("outputs") / config.trainer.project_name / config.trainer.experiment_name
