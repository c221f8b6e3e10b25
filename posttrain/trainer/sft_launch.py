"""Running an SFT or DPO trainer from a command line: the run, its summary, the held-out accuracy before and
after, and verl 0.9's engine SFT entry (``python -m posttrain.trainer.sft_trainer``). The trainer class is
passed in, so this module imports no trainer (the entry modules import it)."""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any

from posttrain.cli_args import yaml_config_file

__all__ = ["engine_sft_cli", "heldout_accuracy", "run_sft"]


def run_sft(trainer_cls: Any, config: Any, heldout: bool) -> int:
    """Build ``trainer_cls(config)``, train, print the summary (and the held-out accuracy before and after when
    ``heldout``); the exit code (128 + the signal for a run stopped by one)."""
    from posttrain.config.sft_load import sft_notes
    from posttrain.trainer.resume import RunFinished
    from posttrain.trainer.run import startup_signals

    for line in sft_notes(config):
        print(f"note: {line}", flush=True)

    before: dict[str, float] = {}

    def heldout_before() -> None:  # after the run's checks (data, folder), before its models load
        before.update(heldout_accuracy(config.model.partial_pretrain, config))

    try:
        with startup_signals():
            trainer = trainer_cls(config, before_models=heldout_before if heldout else None)
        history = trainer.fit()
    except KeyboardInterrupt:
        print("\naborted without saving (second Ctrl-C)", file=sys.stderr)
        return 130
    except RunFinished as finished:  # its model is there: a pipeline started again goes on (exit 0)
        print(finished, flush=True)
        return 0
    _summary(history)
    model_dir, step, stopped_by = trainer.session.model_dir, trainer.global_step, trainer.stopped_by
    if before and model_dir is not None:
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
    """Each figure named by its metric (`posttrain.rewards.arithmetic`): strict, the answer after ``####``;
    flexible, the last number in the reply. The two can move apart (a model learning the format, or the answers)."""
    line = (f"held-out accuracy (built-in arithmetic task, {after['n']} questions, greedy): strict (the #### answer) "
            f"{before['accuracy']:.1%} at step 0 -> {after['accuracy']:.1%} at step {step} "
            f"({(after['accuracy'] - before['accuracy']) * 100:+.1f} points)")
    if "flexible" in before and "flexible" in after:
        line += (f"; flexible (the last number in the reply) {before['flexible']:.1%} -> {after['flexible']:.1%} "
                 f"({(after['flexible'] - before['flexible']) * 100:+.1f} points)")
    print(line, flush=True)


def engine_sft_cli(argv: list[str], trainer_cls: Any, prog: str = "python -m posttrain.trainer.sft_trainer") -> int:
    """verl 0.9's engine SFT (``python -m verl.trainer.sft_trainer``): its keys (`posttrain.config.sft_engine`)
    mapped onto posttrain's SFT run by ``trainer_cls`` (`posttrain.trainer.sft_trainer.SFTTrainer`). ``--cfg job``
    prints the resolved tree and exits."""
    from posttrain.config.sft_engine import load_engine_sft_config, to_sft_config
    from posttrain.config.sft_load import validate_sft_config
    from posttrain.config.verl_keys import no_effect_lines

    parser = argparse.ArgumentParser(prog=prog, description="Supervised fine-tuning with verl 0.9's engine SFT keys "
                                     "(sft_trainer_engine.yaml: model.*, engine.*, optim.*, data.messages_key, ...): "
                                     "verl's defaults, then --config FILE, then the key=value overrides.")
    parser.add_argument("--config", type=yaml_config_file, help="YAML config layered over verl's engine SFT defaults")
    parser.add_argument("--cfg", choices=("job", "all"), default=None,
                        help="print the resolved config after its checks and exit without training (Hydra's flag)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (engine=fsdp style group choices too)")
    args = parser.parse_args(argv)
    engine = load_engine_sft_config(args.config, args.overrides)
    config = to_sft_config(engine)
    validate_sft_config(config)
    lines = no_effect_lines(engine.no_effect)
    if args.cfg is not None:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(config)), end="")
        print("".join(f"# {line}\n" for line in lines), end="")
        return 0
    for line in lines:
        print(f"note: {line}", flush=True)
    return run_sft(trainer_cls, config, False)
