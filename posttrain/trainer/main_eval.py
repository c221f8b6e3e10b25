"""``python -m posttrain.trainer.main_eval data.path=FILE ...`` (verl's `verl.trainer.main_eval`): score a
parquet file of generated responses offline and print the mean score per data source.

verl's evaluation config: ``data.path`` (rows holding ``data.response_key``: a list of responses per
prompt), ``data.data_source_key``, ``data.reward_model_key`` (a dict with ``ground_truth``), and
``custom_reward_function.{path, name}`` (null: the built-in scorers by data source). Each prompt's score is the
mean over its responses; ``test_score/<data_source>`` is the mean over prompts, as verl prints it. To
generate and score in one command, with mean@N, maj@N and pass@k: `posttrain eval`.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from typing import Any

import numpy as np

from posttrain.errors import ConfigError

DEFAULTS = {"data.path": "/tmp/math_Qwen2-7B-Instruct.parquet", "data.prompt_key": "prompt",
            "data.response_key": "responses", "data.data_source_key": "data_source",
            "data.reward_model_key": "reward_model", "custom_reward_function.path": None,
            "custom_reward_function.name": "compute_score", "ray_kwargs.ray_init.num_cpus": None,
            "ray_kwargs.timeline_json_file": None}
"""verl 0.9.1's `evaluation.yaml`, flattened."""


def _settings(overrides: list[str]) -> dict[str, Any]:
    from posttrain.config.load import parse_value, split_override

    settings = dict(DEFAULTS)
    for item in overrides:
        key, text, _ = split_override(item)
        if key not in settings:
            raise ConfigError(f"override '{item}': unknown key '{key}' of verl's evaluation config; "
                              f"valid: {', '.join(DEFAULTS)}")
        settings[key] = parse_value(text)
    return settings


def score_file(settings: dict[str, Any]) -> dict[str, float]:
    """``test_score/<data_source>``: the mean over prompts of each prompt's mean response score."""
    from posttrain.data.schema import read_rows
    from posttrain.rewards.custom import load_custom_reward_fn
    from posttrain.rewards.dispatch import default_compute_score

    rows = read_rows(str(settings["data.path"]))
    fn = load_custom_reward_fn(settings["custom_reward_function.path"], settings["custom_reward_function.name"])
    score = fn or default_compute_score
    per_source: dict[str, list[float]] = defaultdict(list)
    keys = [settings[k] for k in ("data.response_key", "data.data_source_key", "data.reward_model_key")]
    for i, row in enumerate(rows):
        missing = [k for k in keys if k not in row]
        if missing:
            raise ConfigError(f"{settings['data.path']} row {i}: no column {missing[0]!r} (columns: {', '.join(row)})")
        responses, source, reward_data = row[keys[0]], row[keys[1]], row[keys[2]]
        responses = [responses] if isinstance(responses, str) else list(responses)
        values = [_number(score(source, r, reward_data["ground_truth"])) for r in responses]
        per_source[source].append(float(np.mean(values)) if values else 0.0)
    if not per_source:
        raise ConfigError(f"{settings['data.path']} holds no rows")
    return {f"test_score/{source}": float(np.mean(v)) for source, v in per_source.items()}


def _number(result: Any) -> float:
    return float(result["score"] if isinstance(result, dict) else result)


def main(argv: list[str] | None = None) -> int:
    from posttrain.errors import run_cli

    def cli(args: list[str]) -> int:
        parser = argparse.ArgumentParser(prog="python -m posttrain.trainer.main_eval", description=__doc__.splitlines()[0])
        parser.add_argument("overrides", nargs="*", help="key=value overrides of verl's evaluation config")
        print(score_file(_settings(parser.parse_args(args).overrides)))
        return 0

    return run_cli(cli, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
