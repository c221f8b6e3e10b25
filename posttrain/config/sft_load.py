"""Load, check and map the SFT / DPO config trees (`posttrain.config.sft`).

Loading follows the RL loader's rules (dotted overrides as verl scripts write them, YAML layers,
unknown keys refused with "did you mean", types checked); `sft_problems` lists every inconsistency
before any model loads. The trainers run on the RL workers, built from the tree's role specs
(`posttrain.config.sft_roles`), so models, LoRA, FSDP2 ranks and checkpoints are the RL trainer's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from posttrain.config.actor_rollout_ref import HOST_MEMORY_MODES, HOST_PAGING_MODES
from posttrain.config.sft import TRUNCATION_MODES, DPOConfig, SFTConfig
from posttrain.errors import ConfigError

__all__ = ["BUILTIN_DPO", "BUILTIN_SFT", "load_dpo_config", "load_sft_config", "ranks", "sft_problems",
           "validate_sft_config"]

# The built-in runs `posttrain sft` / `posttrain dpo` (and `posttrain plan sft|dpo`) start from when
# no --config is given; --config FILE and the python -m entry point start from verl's defaults.
BUILTIN_SFT = Path(__file__).resolve().parent / "sft_builtin.yaml"
BUILTIN_DPO = Path(__file__).resolve().parent / "dpo_builtin.yaml"


def _rl_key(key: str) -> str:
    if key.startswith(("actor_rollout_ref.", "algorithm.", "critic.")):
        return " (an RL key: the SFT/DPO trainers read the keys of verl's sft_trainer.yaml)"
    return ""


def _load(cls: type, path: str | Path | None, overrides: Iterable[str], base: str | Path | None, prog: str) -> Any:
    """The RL loader's rules (`posttrain.config.load`) on the SFT or DPO tree."""
    from posttrain.config.load import Tree, load_raw, to_dataclass

    return to_dataclass(load_raw(path, overrides, base, Tree(cls, f"{prog} ", _rl_key)))


def ranks(config: SFTConfig) -> int:
    """Data-parallel ranks: torchrun's WORLD_SIZE, else trainer.nnodes x trainer.n_gpus_per_node."""
    from posttrain.launch import launched_by_torchrun, torchrun_world_size

    return torchrun_world_size() if launched_by_torchrun() else config.trainer.nnodes * config.trainer.n_gpus_per_node


def _apply_deprecated(config: SFTConfig) -> SFTConfig:
    """verl's deprecated ``data.micro_batch_size`` (rows over all ranks) becomes rows per rank, as verl does."""
    d = config.data
    if d.micro_batch_size is not None:
        world = ranks(config)
        if d.micro_batch_size <= 0 or world <= 0 or d.micro_batch_size % world:
            raise ConfigError(f"data.micro_batch_size={d.micro_batch_size} (deprecated: rows over all ranks) must be "
                              f"a positive multiple of the {world} ranks; or set data.micro_batch_size_per_gpu")
        d.micro_batch_size_per_gpu = d.micro_batch_size // world
        print(f"note: data.micro_batch_size={d.micro_batch_size} is deprecated; using data.micro_batch_size_per_gpu="
              f"{d.micro_batch_size_per_gpu}", flush=True)
    return config


def load_sft_config(path: str | Path | None = None, overrides: Iterable[str] = (), *,
                    base: str | Path | None = None, validate: bool = True) -> SFTConfig:
    """verl's SFT defaults <- `base` YAML <- `path` YAML <- dotted overrides; validated unless told not to."""
    config = _apply_deprecated(_load(SFTConfig, path, overrides, base, "SFT"))
    if validate:
        validate_sft_config(config)
    return config


def load_dpo_config(path: str | Path | None = None, overrides: Iterable[str] = (), *,
                    base: str | Path | None = None, validate: bool = True) -> DPOConfig:
    """The SFT tree with DPO's data keys and `dpo.*`; validated unless told not to."""
    config = _apply_deprecated(_load(DPOConfig, path, overrides, base, "DPO"))
    if validate:
        validate_sft_config(config)
    return config


# ---------------------------------------------------------------------------------------------- checks
def sft_problems(config: SFTConfig) -> list[str]:
    """Every inconsistency of the tree, each naming its key and what would be valid."""
    from posttrain.config.ranges import SFT_RANGES, named_keys, numeric_problems
    from posttrain.config.validate import trainer_problems

    d, m, o, t = config.data, config.model, config.optim, config.trainer
    out = trainer_problems(t)
    world = ranks(config)
    if d.truncation not in TRUNCATION_MODES:
        out.append(f"data.truncation={d.truncation!r}; valid: {', '.join(TRUNCATION_MODES)}")
    for key, value in (("data.train_batch_size", d.train_batch_size), ("data.micro_batch_size_per_gpu",
                       d.micro_batch_size_per_gpu), ("data.max_length", d.max_length)):
        if not isinstance(value, int) or value <= 0:
            out.append(f"{key}={value!r} must be a positive integer")
    if isinstance(d.train_batch_size, int) and d.train_batch_size > 0 and world > 0 and d.train_batch_size % world:
        out.append(f"data.train_batch_size={d.train_batch_size} must be divisible by the ranks ({world}: torchrun's "
                   "WORLD_SIZE, or trainer.nnodes x trainer.n_gpus_per_node)")
    if o.lr <= 0:
        out.append(f"optim.lr={o.lr} must be positive")
    if m.fsdp_config.host_memory not in HOST_MEMORY_MODES:
        out.append(f"model.fsdp_config.host_memory={m.fsdp_config.host_memory!r}; valid: {', '.join(HOST_MEMORY_MODES)}")
    if m.fsdp_config.host_paging not in HOST_PAGING_MODES:
        out.append(f"model.fsdp_config.host_paging={m.fsdp_config.host_paging!r}; valid: {', '.join(HOST_PAGING_MODES)}")
    if o.lr_scheduler not in ("cosine", "constant"):
        out.append(f"optim.lr_scheduler={o.lr_scheduler!r}; valid: cosine, constant")
    ratio_key = "warmup_steps_ratio" if o.warmup_steps_ratio is not None else "lr_warmup_steps_ratio"  # the one used
    ratio = getattr(o, ratio_key)
    if not 0.0 <= ratio < 1.0:
        out.append(f"optim.{ratio_key}={ratio} must be in [0, 1)")
    if len(o.betas) != 2:
        out.append(f"optim.betas={o.betas} must hold two numbers")
    if o.clip_grad < 0:
        out.append(f"optim.clip_grad={o.clip_grad} must be >= 0 (0: no clipping)")
    if config.use_remove_padding and config.use_prefix_grouper:
        out.append("use_remove_padding and use_prefix_grouper are two layouts of a micro-batch; set one of them")
    if m.use_liger:
        out.append("model.use_liger=True: Liger kernels are not available in posttrain; set False")
    if m.strategy not in ("fsdp", "fsdp2"):
        out.append(f"model.strategy={m.strategy!r}; valid: fsdp2 (fsdp is read as fsdp2)")
    if m.lora_rank < 0 or m.lora_alpha <= 0:
        out.append(f"model.lora_rank={m.lora_rank}, model.lora_alpha={m.lora_alpha}: rank >= 0 and alpha > 0")
    if t.default_hdfs_dir:
        out.append("trainer.default_hdfs_dir: remote checkpoint copies are not supported; set null")
    if isinstance(config, DPOConfig):
        out += _dpo_problems(config)
    # every number the checks above did not name (NaN and inf slip past their comparisons): its declared range
    return out + numeric_problems(config, type(config), SFT_RANGES, skip=named_keys(out))


def _dpo_problems(config: DPOConfig) -> list[str]:
    """The `dpo.*` knobs (checked where they become the update's objective) and DPO's data keys."""
    from posttrain.config.sft import ON_BAD_ROW, SELF_PAIR_REWARD_KEYS

    p, d, out = config.dpo, config.data, []
    try:
        p.objective()
    except ConfigError as err:
        out.append(str(err))
    if d.on_bad_row not in ON_BAD_ROW:
        out.append(f"data.on_bad_row={d.on_bad_row!r}; valid: {', '.join(ON_BAD_ROW)}")
    if d.self_pairs.reward_key not in SELF_PAIR_REWARD_KEYS:
        out.append(f"data.self_pairs.reward_key={d.self_pairs.reward_key!r}; valid: {', '.join(SELF_PAIR_REWARD_KEYS)}")
    if d.multiturn.enable:
        out.append("data.multiturn.enable=True: DPO rows hold prompt/chosen/rejected (text or messages); set False")
    for key in ("prompt_dict_keys", "response_dict_keys"):
        if getattr(d, key) is not None:
            out.append(f"data.{key}={getattr(d, key)}: an SFT key; DPO reads the columns data.prompt_key, "
                       "data.chosen_key and data.rejected_key as they are (text or chat messages); set null")
    return out


def sft_notes(config: SFTConfig) -> list[str]:
    """Settings that have no effect here, one line each (printed before the run starts)."""
    from posttrain.config.validate import ULYSSES_NOTE

    sp = config.ulysses_sequence_parallel_size
    return [f"ulysses_sequence_parallel_size={sp}: {ULYSSES_NOTE}"] if sp != 1 else []


def validate_sft_config(config: SFTConfig) -> None:
    """Raise one ConfigError listing every problem (`sft_problems`), before anything loads."""
    problems = sft_problems(config)
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems) if len(problems) > 1 else problems[0])
