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
import gc
import sys
from typing import Any

from posttrain.config.sft_load import BUILTIN_DPO, BUILTIN_SFT

STARTS = ("key=value overrides land on the built-in run ({builtin}: SmolLM2-135M-Instruct, one process on CPU); "
          "--config FILE starts from verl's sft_trainer.yaml defaults instead, as `python -m "
          "posttrain.trainer.fsdp_sft_trainer` does")


def _run(trainer_cls, config, heldout: bool) -> int:
    from posttrain.trainer.run import startup_signals

    before = heldout_accuracy(config.model.partial_pretrain, config) if heldout else None
    try:
        with startup_signals():
            trainer = trainer_cls(config)
        history = trainer.fit()
    except KeyboardInterrupt:
        print("\naborted without saving (second Ctrl-C)", file=sys.stderr)
        return 130
    _summary(history)
    model_dir, step, stopped_by = trainer.session.model_dir, trainer.global_step, trainer.stopped_by
    if before is not None and model_dir is not None:
        del trainer  # the trained model and its optimizer state go before the exported model loads beside them
        gc.collect()
        _report_heldout(before, heldout_accuracy(str(model_dir), config), step)
        from posttrain.host.process_tree import start_run_peak

        print(f"peak memory with the held-out evaluation: {start_run_peak().peak_bytes() / 1e9:.2f} GB "
              "(process tree)", flush=True)
    return 128 + int(stopped_by) if stopped_by is not None else 0


def _summary(history: list[dict]) -> None:
    for key in ("val/loss", "eval_loss", "eval_rewards/margins", "eval_rewards/accuracies"):
        points = [(row["step"], row[key]) for row in history if key in row]
        if points:
            print(f"{key}: {points[0][1]:.4f} at step {points[0][0]} -> {points[-1][1]:.4f} at step {points[-1][0]}")


def heldout_accuracy(model: str, config: Any) -> dict[str, float]:
    """Greedy accuracy of ``model`` on the built-in arithmetic task's held-out split (`posttrain eval`'s
    data; the split ``data.arithmetic.*`` names when the config has one, as the SFT tree does)."""
    from posttrain.trainer.evaluate import evaluate

    task = getattr(config.data, "arithmetic", None)
    keys = ("digits", "n_train", "n_test", "seed", "prompt_style")
    overrides = [f"data.arithmetic.{k}={getattr(task, k)}" for k in keys if task is not None]
    dtype = config.model.fsdp_config.mixed_precision.param_dtype
    overrides.append(f"actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype={dtype}")
    result = evaluate(model, batch_size=64, overrides=overrides)
    overall = result["overall"]
    flexible = [v["flexible_accuracy"] for v in result["per_source"].values() if "flexible_accuracy" in v]
    return {"n": overall["n"], "accuracy": overall["accuracy"], **({"flexible": flexible[0]} if flexible else {})}


def _report_heldout(before: dict[str, float], after: dict[str, float], step: int) -> None:
    line = (f"held-out accuracy (built-in arithmetic task, {after['n']} questions, greedy): "
            f"{before['accuracy']:.1%} at step 0 -> {after['accuracy']:.1%} at step {step} "
            f"({(after['accuracy'] - before['accuracy']) * 100:+.1f} points)")
    if "flexible" in before and "flexible" in after:
        line += (f"; flexible {before['flexible']:.1%} -> {after['flexible']:.1%} "
                 f"({(after['flexible'] - before['flexible']) * 100:+.1f} points)")
    print(line, flush=True)


def _parser(prog: str, description: str, builtin: Any) -> argparse.ArgumentParser:
    starts = STARTS.format(builtin=f"posttrain/config/{builtin.name}") if builtin else \
        "starts from verl's sft_trainer.yaml defaults, then --config FILE, then the key=value overrides"
    parser = argparse.ArgumentParser(prog=prog, description=f"{description} {starts}.")
    parser.add_argument("--config", help="YAML config layered over verl's defaults (replaces the built-in run)")
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
