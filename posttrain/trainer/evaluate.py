"""`posttrain eval`: greedy accuracy of a model or checkpoint on a dataset, per data source.

    posttrain eval --model smollm2-135m-instruct                       # the built-in arithmetic test split
    posttrain eval --model checkpoints/p/e/global_step_15 --data ~/data/gsm8k/test.parquet --n 200
    posttrain eval --model ./my_hf_folder --json data.arithmetic.digits=2

MODEL is a Hugging Face folder, a ``.gguf`` file, the alias ``smollm2-135m-instruct``, a hub id, or a
posttrain checkpoint (a ``global_step_N`` folder, its ``actor/`` subfolder, or a checkpoint root for
its latest checkpoint; the actor is rebuilt from ``actor/huggingface`` config + weights, as
``posttrain export`` does). The data defaults to the built-in run's test split (``data.val_files``
of ``posttrain/config/builtin.yaml``, i.e. the built-in arithmetic task); ``key=value`` overrides
apply on top of the built-in config (``data.max_prompt_length``, ``data.arithmetic.*``,
``custom_reward_function.path``, ``actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype``...).

Each prompt gets one greedy response (``--max-response-length`` tokens at most) from the trainer's
hf rollout engine; the reward manager scores it (``default_compute_score`` by ``data_source``, or
the configured custom reward function). Accuracy is the mean score: per data source, and overall
(over all prompts).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from posttrain.config import BUILTIN_CONFIG

__all__ = ["build_parser", "evaluate", "main", "resolve_model"]


def _is_checkpoint(path: str) -> bool:
    from posttrain.checkpoint import CheckpointError
    from posttrain.trainer.export import resolve_checkpoint

    p = Path(path).expanduser()
    if not p.is_dir() or (p / "config.json").exists():
        return False
    try:
        resolve_checkpoint(p)
    except (CheckpointError, OSError, ValueError):
        return False
    return True


@contextlib.contextmanager
def resolve_model(path: str):
    """Yields a path ``load_causal_lm`` takes: ``path`` itself, or a checkpoint's actor exported to a
    temporary Hugging Face folder (removed afterwards)."""
    if not _is_checkpoint(path):
        yield str(path)
        return
    from posttrain.trainer.export import export_actor

    with tempfile.TemporaryDirectory(prefix="posttrain_eval_") as tmp:
        yield str(export_actor(Path(path).expanduser(), tmp))


def _config(model: str, data: list[str] | None, max_response_length: int | None, batch_size: int | None,
            overrides: list[str]):
    from posttrain.config import load_config

    items = [f"actor_rollout_ref.model.path={model}"]
    if data:
        items.append("data.val_files=[" + ",".join(json.dumps(os.path.expanduser(f)) for f in data) + "]")
    if max_response_length is not None:
        items.append(f"data.max_response_length={max_response_length}")
    if batch_size is not None:
        items.append(f"data.val_batch_size={batch_size}")
    base = BUILTIN_CONFIG if BUILTIN_CONFIG.is_file() else None
    # training-only keys (batch sizes per GPU, ...) may be unset or inconsistent: not validated here
    return load_config(overrides=items + list(overrides), base=base, validate=False)


def evaluate(model: str, data: list[str] | None = None, *, n: int | None = None,
             max_response_length: int | None = None, batch_size: int | None = None,
             overrides: list[str] = (), tokenizer: str | None = None) -> dict[str, Any]:
    """Greedy accuracy; returns ``{"model", "data", "max_response_length", "per_source": {source:
    {"n", "accuracy"}}, "overall": {"n", "accuracy"}, "rows": [{"data_source", "prompt", "response",
    "ground_truth", "score"}]}``. ``n``: only the first ``n`` prompts of the dataset."""
    import torch

    from posttrain.data import RLHFDataset, build_val_loader
    from posttrain.rollout import SamplingParams
    from posttrain.trainer.setup import build_reward_fn, data_files
    from posttrain.trainer.validation import run_validation

    if n is not None and n < 1:  # a negative n would be a Python slice: rows[:-3] drops three rows
        from posttrain.config import ConfigError

        raise ConfigError(f"n={n}: the number of prompts to evaluate must be >= 1 (or None for all)")
    _check_model_flags(model, tokenizer)
    with resolve_model(model) as path:
        config = _config(path, data, max_response_length, batch_size, list(overrides))
        tok, module, device = _load_model(config, path, tokenizer)
    files = data_files(config)[1]
    dataset = RLHFDataset(files, tok, config.data)
    if n is not None:
        dataset.rows, dataset.input_ids = dataset.rows[:n], dataset.input_ids[:n]
    loader = build_val_loader(dataset, config.data)
    engine = _greedy_engine(config, module, tok, device)
    length = int(config.data.max_response_length)
    sampling = SamplingParams(n=1, temperature=0.0, do_sample=False, response_length=length,
                              calculate_log_probs=False)
    reward_fn = build_reward_fn(config, tok)
    with torch.no_grad():
        metrics, samples = run_validation(list(loader), lambda p: engine.generate(p, sampling), reward_fn, 1,
                                          config.data.reward_fn_key)
    rows = _rows(samples, tok, config.data.reward_fn_key)
    return _result(model, files, length, metrics, rows)


def _check_model_flags(model: str, tokenizer: str | None) -> None:
    """``--model`` / ``--tokenizer`` name a model (or a checkpoint): a `ConfigError` naming the flag otherwise."""
    from posttrain.config import ConfigError
    from posttrain.trainer.preflight import model_path_problem

    for flag, value in (("--model", model), ("--tokenizer", tokenizer)):
        problem = None if value is None or _is_checkpoint(value) else model_path_problem(value)
        if problem is not None:
            raise ConfigError(f"{flag} {value}: {problem}")


def _load_model(config: Any, path: str, tokenizer: str | None):
    """(tokenizer, the policy on the run's device in eval mode, the device), loaded as a role is
    (`posttrain.workers.prepare.load_role_model`)."""
    from posttrain.models import load_tokenizer
    from posttrain.trainer.setup import resolve_device
    from posttrain.workers.prepare import load_role_model

    m = config.actor_rollout_ref.model
    tok = load_tokenizer(tokenizer or path, trust_remote_code=m.trust_remote_code,
                         custom_chat_template=m.custom_chat_template)
    device = resolve_device(config)
    module = load_role_model("policy", m, config.actor_rollout_ref.actor.fsdp_config.model_dtype).to(device)
    return tok, module.eval(), device


def _greedy_engine(config: Any, module: Any, tok: Any, device: Any):
    """The trainer's rollout engine on ``module``, computing in the actor's ``param_dtype`` (``auto``:
    decided as for training, `posttrain.workers.prepare.decide_param_dtype`)."""
    from posttrain.models import autocast_context
    from posttrain.rollout import get_rollout_engine
    from posttrain.workers.prepare import decide_param_dtype

    param_dtype = decide_param_dtype(config.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype,
                                     module, device)
    engine = get_rollout_engine(config.actor_rollout_ref.rollout.name, model=module, tokenizer=tok,
                                autocast=functools.partial(autocast_context, device, param_dtype))
    if config.actor_rollout_ref.rollout.multi_turn.enable:  # tools / interactions between turns
        from posttrain.rollout.multi_turn import MultiTurnRollout

        engine = MultiTurnRollout.from_config(engine, tok, config.actor_rollout_ref.rollout)
    return engine


def _rows(samples: list[dict], tok: Any, key: str) -> list[dict[str, Any]]:
    """One row per response: data source, prompt, response text, ground truth, score."""
    rows = []
    for sample in samples:
        out = sample["batch"]
        mask = out["attention_mask"][:, -out["responses"].shape[1]:].bool()  # multi-turn: tool/user turns too
        texts = tok.batch_decode([r[k].tolist() for r, k in zip(out["responses"], mask)], skip_special_tokens=True)
        prompts = tok.batch_decode([p[a.bool()].tolist() for p, a in zip(out["prompts"],
                                                                         out["attention_mask"][:, :out["prompts"].shape[1]])],
                                   skip_special_tokens=False)
        calls = out.non_tensor_batch.get("multi_turn/tool_calls")
        for i, score in enumerate(sample["scores"]):
            rows.append({"data_source": str(out.non_tensor_batch[key][i]), "prompt": prompts[i], "response": texts[i],
                         "ground_truth": out.non_tensor_batch["reward_model"][i].get("ground_truth"),
                         "score": float(score), **({"tool_calls": float(calls[i])} if calls is not None else {})})
    return rows


def _result(model: str, files: Any, length: int, metrics: dict[str, float], rows: list[dict]) -> dict[str, Any]:
    """Accuracy per data source and overall (the mean score), with the rows."""
    per: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        per[r["data_source"]].append(r["score"])
    scores = [r["score"] for r in rows]
    return {
        "model": model,
        "data": files if isinstance(files, list) else [files],
        "max_response_length": length,
        "per_source": {s: {"n": len(v), "accuracy": sum(v) / len(v), **_flexible(metrics, s)}
                       for s, v in sorted(per.items())},
        "overall": {"n": len(scores), "accuracy": sum(scores) / len(scores) if scores else float("nan"),
                    **_tool_use(rows)},
        "rows": rows,
    }


def _tool_use(rows: list[dict]) -> dict[str, float]:
    """Multi-turn runs: the share of rows that called a tool at least once."""
    calls = [r["tool_calls"] for r in rows if "tool_calls" in r]
    return {"tool_call_rate": sum(c > 0 for c in calls) / len(calls)} if calls else {}


def _flexible(metrics: dict[str, float], source: str) -> dict[str, float]:
    """The scorer's flexible accuracy (last number in the reply) where it reports one."""
    value = metrics.get(f"val-aux/{source}/flexible_acc/mean@1")
    return {} if value is None else {"flexible_accuracy": value}


def format_result(res: dict[str, Any], show: int = 0) -> str:
    width = max([len("data_source"), len("overall")] + [len(s) for s in res["per_source"]])
    lines = [f"model: {res['model']}", f"data: {', '.join(map(str, res['data']))}",
             f"greedy, at most {res['max_response_length']} new tokens",
             f"{'data_source':<{width}}  {'n':>6}  {'accuracy':>8}  {'flexible':>8}"]
    for source, v in res["per_source"].items():
        flexible = f"{v['flexible_accuracy']:>8.4f}" if "flexible_accuracy" in v else f"{'-':>8}"
        lines.append(f"{source:<{width}}  {v['n']:>6}  {v['accuracy']:>8.4f}  {flexible}")
    lines.append(f"{'overall':<{width}}  {res['overall']['n']:>6}  {res['overall']['accuracy']:>8.4f}")
    for r in res["rows"][:show]:
        lines.append(f"--- score {r['score']:g} (ground truth {r['ground_truth']}): {r['response']!r}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from posttrain.cli_args import non_negative_int, positive_int

    parser = argparse.ArgumentParser(
        prog="posttrain eval", description="Greedy accuracy of a model or checkpoint on a dataset, per data source.")
    parser.add_argument("--model", required=True,
                        help="HF folder, .gguf file, smollm2-135m-instruct, hub id, or a checkpoint (global_step_N)")
    parser.add_argument("--data", nargs="+", action="extend", metavar="FILE",
                        help="parquet/jsonl files in verl's schema (default: the built-in run's test split)")
    parser.add_argument("--n", type=positive_int, default=None, help="evaluate only the first N prompts")
    parser.add_argument("--max-response-length", type=positive_int, default=None,
                        help="new tokens per response (default: data.max_response_length of the built-in config)")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="prompts per generation batch (default: all)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path when the model folder has none")
    parser.add_argument("--show", type=non_negative_int, default=0, metavar="K",
                        help="also print the first K responses")
    parser.add_argument("--json", action="store_true", help="print the result (with every response) as JSON")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides (over the built-in config)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    data, overrides = [], list(args.overrides)
    for item in args.data or []:  # `--data a.parquet key=value`: the override is not a file
        (overrides if "=" in item and not Path(item).expanduser().exists() else data).append(item)
    from posttrain.config import ConfigError
    from posttrain.data import DataError
    from posttrain.checkpoint import CheckpointError

    try:
        res = evaluate(args.model, data or None, n=args.n, max_response_length=args.max_response_length,
                       batch_size=args.batch_size, overrides=overrides, tokenizer=args.tokenizer)
    except (ConfigError, DataError, CheckpointError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=1, default=str) if args.json else format_result(res, args.show))
    return 0


if __name__ == "__main__":
    from posttrain.errors import run_cli

    sys.exit(run_cli(main, sys.argv[1:]))
