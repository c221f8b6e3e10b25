"""Entry points of the SFT and DPO trainers.

    posttrain sft [key=value ...]                                # the built-in SFT run, then the overrides
    posttrain dpo key=value ...                                  # the built-in DPO run, then the overrides
    posttrain sft|dpo --config FILE [key=value ...]              # verl's sft_trainer.yaml defaults, FILE, overrides
    python -m posttrain.trainer.fsdp_sft_trainer key=value ...   # verl's sft_trainer.yaml defaults, then overrides

As with `posttrain train`: the built-in runs (`posttrain/config/sft_builtin.yaml`, `dpo_builtin.yaml`)
are one process on CPU, and a verl SFT launch script runs with `verl` replaced by `posttrain` (ranks
from ``trainer.nnodes x trainer.n_gpus_per_node``, Ray). `posttrain sft` on the built-in rows and
`posttrain dpo` also report the greedy held-out accuracy on the built-in arithmetic task before and
after training (``--no-heldout-eval`` skips it). User errors print one ``error:`` line.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from posttrain.cli_args import yaml_config_file
from posttrain.config.sft_load import BUILTIN_DPO, BUILTIN_SFT
from posttrain.trainer.sft_launch import heldout_accuracy, run_sft as _run

__all__ = ["dpo_cli", "heldout_accuracy", "main", "sft_cli"]

STARTS = ("key=value overrides land on the built-in run ({builtin}: SmolLM2-135M-Instruct, one process on CPU); "
          "--config FILE starts from verl's sft_trainer.yaml defaults instead, as `python -m "
          "posttrain.trainer.fsdp_sft_trainer` does")


def _parser(prog: str, description: str, builtin: Any) -> argparse.ArgumentParser:
    starts = STARTS.format(builtin=f"posttrain/config/{builtin.name}") if builtin else \
        "starts from verl's sft_trainer.yaml defaults, then --config FILE, then the key=value overrides"
    parser = argparse.ArgumentParser(prog=prog, description=f"{description} {starts}.")
    parser.add_argument("--config", type=yaml_config_file,
                        help="YAML config layered over verl's defaults (replaces the built-in run)")
    if builtin is not None:
        parser.add_argument("--heldout-eval", action=argparse.BooleanOptionalAction, default=None,
                            help="greedy held-out accuracy on the built-in arithmetic task before and after "
                                 "(default: on for the built-in rows, and for posttrain dpo)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    return parser


def sft_cli(argv: list[str], builtin: bool) -> int:
    from posttrain.config.sft_load import load_sft_config
    from posttrain.trainer.sft_trainer import SFTTrainer

    parser = _parser("posttrain sft" if builtin else "python -m posttrain.trainer.fsdp_sft_trainer",
                     "Supervised fine-tuning with verl's SFT keys.", BUILTIN_SFT if builtin else None)
    args = parser.parse_args(argv)
    base = BUILTIN_SFT if builtin and args.config is None else None
    config = load_sft_config(args.config, args.overrides, base=base)
    heldout = getattr(args, "heldout_eval", False)
    return _run(SFTTrainer, config, config.data.train_files is None if heldout is None else heldout)


def dpo_cli(argv: list[str]) -> int:
    from posttrain.config.sft_load import load_dpo_config
    from posttrain.trainer.dpo_trainer import DPOTrainer

    parser = _parser("posttrain dpo", "Offline DPO on preference pairs (prompt, chosen, rejected): the SFT keys "
                     "plus dpo.* (TRL's names).", BUILTIN_DPO)
    args = parser.parse_args(argv)
    base = BUILTIN_DPO if args.config is None else None
    config = load_dpo_config(args.config, args.overrides, base=base)
    return _run(DPOTrainer, config, True if args.heldout_eval is None else args.heldout_eval)


def main(argv: list[str] | None = None) -> int:
    """``python -m posttrain.trainer.fsdp_sft_trainer``: verl's defaults, then the overrides."""
    from posttrain.errors import run_cli

    return run_cli(lambda a: sft_cli(a, builtin=False), list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    from posttrain.host.allocator import bound_kernel_caches
    from posttrain.host.threads import choose_wait_policy

    choose_wait_policy()  # torch is not loaded yet (posttrain.host.threads says why)
    bound_kernel_caches()  # before the first matmul (posttrain.host.allocator says why)
    sys.exit(main())
