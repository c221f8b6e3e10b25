"""Entry points: `python -m posttrain.trainer.main_ppo key=value ...` (a verl launch script with
`verl` replaced by `posttrain`: verl's defaults, then the overrides) and `posttrain train`
(the built-in default run, then the overrides)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from posttrain.config import ConfigError, load_config

BUILTIN_CONFIG = Path(__file__).resolve().parents[1] / "config" / "builtin.yaml"


def run(config) -> int:
    from posttrain.trainer.report import summarize_run
    from posttrain.trainer.trainer import NonFiniteError, RLTrainer

    try:
        trainer = RLTrainer(config)
        history = trainer.fit()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NonFiniteError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("\naborted without saving (second Ctrl-C)", file=sys.stderr)
        return 130
    summarize_run(trainer, history)
    return 0


def train_cli(argv: list[str], builtin: bool) -> int:
    parser = argparse.ArgumentParser(prog="posttrain train" if builtin else "python -m posttrain.trainer.main_ppo",
                                     description="Train with RL. Overrides use verl's keys: key=value ...")
    parser.add_argument("--config", help="YAML config layered over the defaults (replaces the built-in run)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_args(argv)
    base = BUILTIN_CONFIG if builtin and args.config is None else None
    try:
        config = load_config(args.config, args.overrides, base=base)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return run(config)


def main(argv: list[str] | None = None) -> int:
    return train_cli(list(sys.argv[1:] if argv is None else argv), builtin=False)


if __name__ == "__main__":
    sys.exit(main())
