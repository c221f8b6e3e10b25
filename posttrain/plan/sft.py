"""``posttrain plan sft|dpo [--config FILE] key=value ...``: what an SFT or DPO run will do, before it starts.

The batch flow (rows per step, per rank, micro-batches), the steps and the lr schedule, validation and
checkpoints, the models held (DPO's reference: a frozen copy, the LoRA policy with its adapters disabled,
or no model when the log-probs are precomputed) and every config problem, without loading a model.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from posttrain.cli_args import yaml_config_file

__all__ = ["describe", "main"]


def _rows(files: Any, max_samples: int) -> int | None:
    from posttrain.data.sft import load_sft_rows

    if files is None:
        return None
    try:
        rows = len(load_sft_rows(files))
    except Exception:  # unreadable here: the trainer names the problem at start-up
        return None
    return min(rows, max_samples) if max_samples and max_samples > 0 else rows


def describe(config: Any, stage: str) -> str:
    """The plan as text (`main`)."""
    from posttrain.config.sft_load import ranks, sft_problems

    d, m, o, t = config.data, config.model, config.optim, config.trainer
    world = ranks(config)
    per_rank = d.train_batch_size // max(world, 1)
    unit = "pairs" if stage == "dpo" else "rows"
    micro = d.micro_batch_size_per_gpu
    lines = [f"{stage.upper()} plan: {m.partial_pretrain}"]
    lora = f"LoRA rank {m.lora_rank}, alpha {m.lora_alpha} on {m.target_modules}" if m.lora_rank > 0 else "full fine-tuning"
    lines.append(f"  model: {lora}; FSDP2 over {world} rank(s); compute {m.fsdp_config.mixed_precision.param_dtype}")
    lines.append(f"  one step: {d.train_batch_size} {unit} -> {per_rank} per rank -> {math.ceil(per_rank / micro)} "
                 f"micro-batch(es) of <= {micro} {unit} (gradient accumulation) -> one optimizer step")
    if stage == "dpo":
        p = config.dpo
        ref = ("precomputed once from the starting weights (no reference model)" if p.precompute_ref_log_probs else
               "the policy with its LoRA adapters disabled (no second model)" if m.lora_rank > 0 else
               "a frozen copy of the starting model (a second model in memory)")
        lines.append(f"  loss: {p.loss_type}, beta {p.beta}, label smoothing {p.label_smoothing}; mean over all "
                     f"pairs of all ranks; each pair = 2 rows sharing their prompt")
        lines.append(f"  reference: {ref}")
    else:
        lines.append("  loss: NLL per trained token (answers and their end-of-turn token) over the whole batch")
    builtin = d.train_files is None and stage == "sft"  # the built-in arithmetic rows
    rows = d.arithmetic.n_train if builtin else _rows(d.train_files, d.train_max_samples)
    per_epoch = rows // d.train_batch_size if rows else None
    total = t.total_training_steps or (t.total_epochs * per_epoch if per_epoch else None)
    count = f"{rows} training {unit}, {per_epoch} steps per epoch" if rows else "training rows not counted here"
    lines.append(f"  steps: {total if total else '?'} ({count}; trainer.total_epochs={t.total_epochs}, "
                 f"trainer.total_training_steps={t.total_training_steps})")
    ratio = o.warmup_steps_ratio if o.warmup_steps_ratio is not None else o.lr_warmup_steps_ratio
    lines.append(f"  lr: {o.lr}, warm-up {ratio:.0%} of the steps, then {o.lr_scheduler}; grad clip {o.clip_grad}")
    lines.append(f"  validation: {'every %d steps' % t.test_freq if t.test_freq > 0 else 'never'} "
                 f"({'val/loss' if stage == 'sft' else 'eval_loss, eval_rewards/*'} on data.val_files)")
    lines.append(f"  checkpoints: {'every %d steps' % t.save_freq if t.save_freq > 0 else 'none'} into "
                 f"{t.default_local_dir} (global_step_N/actor, as RL runs), resume_mode={t.resume_mode}")
    problems = sft_problems(config)
    lines += ["  problems:"] + [f"    - {p}" for p in problems] if problems else ["  problems: none found"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from posttrain.config.sft_load import BUILTIN_DPO, BUILTIN_SFT, load_dpo_config, load_sft_config
    from posttrain.errors import ConfigError

    stage, rest = argv[0], argv[1:]
    parser = argparse.ArgumentParser(prog=f"posttrain plan {stage}", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=yaml_config_file,
                        help="YAML config layered over verl's defaults (without it: the built-in run)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_args(rest)
    loader = load_sft_config if stage == "sft" else load_dpo_config
    base = None if args.config else BUILTIN_SFT if stage == "sft" else BUILTIN_DPO  # as `posttrain sft|dpo` start
    try:
        config = loader(args.config, args.overrides, base=base, validate=False)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = describe(config, stage)
    print(text)
    return 1 if "problems: none found" not in text else 0
