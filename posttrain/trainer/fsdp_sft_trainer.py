"""Entry points of the SFT and DPO trainers.

    python -m posttrain.trainer.fsdp_sft_trainer key=value ...   # verl's sft_trainer.yaml defaults
    posttrain sft [key=value ...]                                # the built-in SFT run, then overrides
    posttrain dpo key=value ...                                  # the DPO tree (TRL's dpo.* names)

A verl SFT launch script runs with `verl` replaced by `posttrain`; ranks come from
``trainer.nnodes x trainer.n_gpus_per_node`` (Ray). User errors print one ``error:`` line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BUILTIN_SFT = Path(__file__).resolve().parent.parent / "config" / "sft_builtin.yaml"


def _run(trainer_cls, config) -> int:
    from posttrain.trainer.run import startup_signals

    try:
        with startup_signals():
            trainer = trainer_cls(config)
        history = trainer.fit()
    except KeyboardInterrupt:
        print("\naborted without saving (second Ctrl-C)", file=sys.stderr)
        return 130
    _summary(history)
    return 128 + int(trainer.stopped_by) if trainer.stopped_by is not None else 0


def _summary(history: list[dict]) -> None:
    for key in ("val/loss", "eval_loss", "eval_rewards/margins", "eval_rewards/accuracies"):
        points = [(row["step"], row[key]) for row in history if key in row]
        if points:
            print(f"{key}: {points[0][1]:.4f} at step {points[0][0]} -> {points[-1][1]:.4f} at step {points[-1][0]}")


def sft_cli(argv: list[str], builtin: bool) -> int:
    from posttrain.config.sft_load import load_sft_config
    from posttrain.trainer.sft_trainer import SFTTrainer

    parser = argparse.ArgumentParser(prog="posttrain sft" if builtin else "python -m posttrain.trainer.fsdp_sft_trainer",
                                     description="Supervised fine-tuning with verl's SFT keys: key=value ...")
    parser.add_argument("--config", help="YAML config layered over the defaults (replaces the built-in run)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_args(argv)
    base = BUILTIN_SFT if builtin and args.config is None else None
    return _run(SFTTrainer, load_sft_config(args.config, args.overrides, base=base))


def dpo_cli(argv: list[str]) -> int:
    from posttrain.config.sft_load import load_dpo_config
    from posttrain.trainer.dpo_trainer import DPOTrainer

    parser = argparse.ArgumentParser(prog="posttrain dpo", description="Offline DPO on preference pairs (prompt, "
                                     "chosen, rejected); the SFT keys plus dpo.* (TRL's names).")
    parser.add_argument("--config", help="YAML config layered over the defaults")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_args(argv)
    return _run(DPOTrainer, load_dpo_config(args.config, args.overrides))


def main(argv: list[str] | None = None) -> int:
    """``python -m posttrain.trainer.fsdp_sft_trainer``: verl's defaults, then the overrides."""
    from posttrain.errors import run_cli

    return run_cli(lambda a: sft_cli(a, builtin=False), list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    from posttrain.host.allocator import keep_freed_memory
    from posttrain.host.threads import choose_wait_policy

    choose_wait_policy()  # torch is not loaded yet (posttrain.host.threads says why)
    keep_freed_memory()
    sys.exit(main())
