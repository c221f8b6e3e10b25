"""`posttrain eval`: a model or checkpoint on a dataset, with verl's validation metrics per data source,
the unbiased pass@k, and an eval card beside the numbers.

    posttrain eval --model smollm2-135m-instruct                       # greedy, the built-in arithmetic test split
    posttrain eval --model smollm2-135m-instruct --n 8                 # 8 samples per prompt: mean@8, maj@8, pass@k
    posttrain eval --model checkpoints/p/e/global_step_15 --data ~/data/gsm8k/test.parquet --limit 200
    posttrain eval --model ./my_hf_folder --json data.arithmetic.digits=2

MODEL is a Hugging Face folder, a ``.gguf`` file, the alias ``smollm2-135m-instruct``, a hub id, or a
posttrain checkpoint (a ``global_step_N`` folder, its ``actor/`` subfolder, or a checkpoint root for
its latest checkpoint; the actor is rebuilt from ``actor/huggingface`` config + weights, as
``posttrain export`` does). The data defaults to the built-in run's test split (``data.val_files``
of ``posttrain/config/builtin.yaml``, i.e. the built-in arithmetic task); ``key=value`` overrides
apply on top of the built-in config (``data.max_prompt_length``, ``data.arithmetic.*``,
``custom_reward_function.path``, ``actor_rollout_ref.rollout.val_kwargs.*``,
``actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype``...).

Sampling is in-run validation's: ``actor_rollout_ref.rollout.val_kwargs.{n, temperature, top_p, top_k,
do_sample}`` (the built-in config's: greedy, one response); ``--n``, ``--temperature`` and ``--top-p`` set
them. ``--n N`` above 1 on a greedy config samples at temperature 1 (N greedy responses would be one
response N times) unless ``val_kwargs.temperature`` / ``do_sample`` are given as overrides; sampling draws
from ``--seed`` (``trainer.seed``). Responses come from the trainer's rollout engine (``--max-response-length``
tokens at most); the reward manager scores them (``default_compute_score`` by ``data_source``, or the
configured custom reward function). The metrics are in-run validation's (`posttrain.trainer.validation`:
verl's ``val-core/<data_source>/<field>/mean@N``, ``best@N/mean``, ``maj@N/mean``... and
``val-aux/.../pass@k``); accuracy is the mean score, per data source and overall. The eval card
(`posttrain.trainer.eval_card`: model and weights hash, data and its hash, chat template, sampling, seed,
scorer, version, machine) is written to ``--output`` and returned in the result.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from posttrain.config import BUILTIN_CONFIG

__all__ = ["build_parser", "evaluate", "main", "resolve_model"]

DEFAULT_OUTPUT = Path("outputs") / "eval"
"""Where `posttrain eval` writes its eval cards unless ``--output`` says otherwise."""


def _is_checkpoint(path: str) -> bool:
    from posttrain.errors import CheckpointError
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


def _sampling_overrides(n: int | None, temperature: float | None, top_p: float | None, seed: int | None,
                        overrides: list[str]) -> list[str]:
    """``val_kwargs`` and ``trainer.seed`` items for the flags given; ``n > 1`` without a temperature on a
    greedy config samples at temperature 1 (added later, in `_sample_when_asked_for_n`)."""
    vk = "actor_rollout_ref.rollout.val_kwargs"
    items = [] if n is None else [f"{vk}.n={n}"]
    if temperature is not None:
        items += [f"{vk}.temperature={temperature}", f"{vk}.do_sample=True"]
    if top_p is not None:
        items.append(f"{vk}.top_p={top_p}")
    if seed is not None:
        items.append(f"trainer.seed={seed}")
    return items


def _sample_when_asked_for_n(config: Any, overrides: list[str]) -> str | None:
    """n > 1 on a greedy ``val_kwargs`` that no override made greedy: sample at temperature 1 (returns the
    note that says so), since n greedy responses are one response n times."""
    vk = config.actor_rollout_ref.rollout.val_kwargs
    greedy = not vk.do_sample or vk.temperature <= 0
    chosen = any(re.match(r"^\+*actor_rollout_ref\.rollout\.val_kwargs\.(temperature|do_sample)=", o) for o in overrides)
    if vk.n <= 1 or not greedy or chosen:
        return None
    vk.temperature, vk.do_sample = 1.0, True
    return (f"val_kwargs.n={vk.n} on a greedy config: sampling at temperature 1.0 (set --temperature, or "
            "actor_rollout_ref.rollout.val_kwargs.do_sample=False for one greedy response)")


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


def _check_counts(limit: int | None, n: int | None, temperature: float | None, top_p: float | None) -> None:
    from posttrain.config import ConfigError

    # a negative limit would be a Python slice: rows[:-3] drops three rows
    for name, value, low in (("limit", limit, 1), ("n", n, 1)):
        if value is not None and value < low:
            what = "prompts to evaluate" if name == "limit" else "responses per prompt"
            raise ConfigError(f"{name}={value}: the number of {what} must be >= 1 (or None for the default)")
    if temperature is not None and not temperature > 0:
        raise ConfigError(f"temperature={temperature}: must be > 0 (greedy decoding is the default for n=1)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ConfigError(f"top_p={top_p}: must be in (0, 1]")


def evaluate(model: str, data: list[str] | None = None, *, limit: int | None = None, n: int | None = None,
             temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
             max_response_length: int | None = None, batch_size: int | None = None,
             overrides: list[str] = (), tokenizer: str | None = None,
             output: str | os.PathLike | None = None) -> dict[str, Any]:
    """Score ``model`` on ``data``; returns ``{"model", "data", "max_response_length", "sampling", "per_source":
    {source: {"n": prompts, "responses", "accuracy", ["flexible_accuracy"]}}, "overall": {...}, "metrics":
    {verl's names: value}, "rows": [{"data_source", "uid", "prompt", "response", "ground_truth", "score"}],
    "card": the eval card, "card_path": where it was written (None without ``output``)}``.

    ``limit``: only the first ``limit`` prompts; ``n``, ``temperature``, ``top_p``: ``val_kwargs``
    (module docstring); ``seed``: ``trainer.seed``; ``output``: a folder for the card (None: not written)."""
    import torch

    from posttrain.data import RLHFDataset, build_val_loader
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.seeding import SEED_KEY, seeded_sampling
    from posttrain.trainer.preflight import check_data_sources
    from posttrain.trainer.setup import build_reward_fn, data_files
    from posttrain.trainer.validation import run_validation

    _check_counts(limit, n, temperature, top_p)
    _check_model_flags(model, tokenizer)
    _check_data_flag(data)
    overrides = list(overrides)
    with resolve_model(model) as path:
        config = _config(path, data, max_response_length, batch_size,
                         _sampling_overrides(n, temperature, top_p, seed, overrides) + overrides)
        note = _sample_when_asked_for_n(config, overrides)
        tok = _load_tokenizer(config, path, tokenizer)
        files = data_files(config)[1]
        dataset = RLHFDataset(files, tok, config.data)  # every row read and checked before the policy loads
        if limit is not None:
            dataset.rows, dataset.input_ids = dataset.rows[:limit], dataset.input_ids[:limit]
        reward_fn = build_reward_fn(config, tok)
        check_data_sources(config, reward_fn, val=dataset)  # not at the first unknown row's score
        module, device = _load_policy(config)
    if note:
        print(note, file=sys.stderr, flush=True)
    loader = build_val_loader(dataset, config.data)
    engine, param_dtype = _engine(config, module, tok, device)
    length = int(config.data.max_response_length)
    rollout = config.actor_rollout_ref.rollout
    sampling = dataclasses.replace(SamplingParams.from_rollout_config(rollout, validate=True), response_length=length,
                                   calculate_log_probs=False)
    batches = list(loader)
    with torch.no_grad(), seeded_sampling({SEED_KEY: int(config.trainer.seed)}):
        metrics, samples = run_validation(batches, lambda p: engine.generate(p, sampling), reward_fn, sampling.n,
                                          config.data.reward_fn_key)
    rows = _rows(samples, tok, config.data.reward_fn_key)
    res = _result(model, files, length, metrics, rows, _sampling_summary(rollout, sampling, int(config.trainer.seed)))
    res["card"] = _card(config, model, module, tok, files, sum(len(b) for b in batches), sampling, param_dtype, metrics)
    res["card_path"] = None if output is None else str(_write(res["card"], output, model))
    return res


def _sampling_summary(rollout: Any, sampling: Any, seed: int) -> dict[str, Any]:
    return {"n_requested": int(rollout.val_kwargs.n), "n": sampling.n, "do_sample": sampling.do_sample,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k, "seed": seed}


def _card(config: Any, model: str, module: Any, tok: Any, files: Any, prompts: int, sampling: Any,
          param_dtype: str, metrics: dict[str, float]) -> dict[str, Any]:
    """The eval card of this evaluation (`posttrain.trainer.eval_card`)."""
    from posttrain.trainer import eval_card

    digest, weights = eval_card.model_weights_sha256(module)
    m = config.actor_rollout_ref.model
    info = {**eval_card.sampling_info(config.actor_rollout_ref.rollout), "n": sampling.n,
            "max_response_length": sampling.response_length}
    return eval_card.build_card(
        kind="eval", model={"path": model, "weights_sha256": digest, "compute_dtype": param_dtype, **weights},
        data=eval_card.files_info(files), prompts=prompts,
        chat_template=eval_card.chat_template_info(tok, m.custom_chat_template), sampling=info,
        seed=int(config.trainer.seed), scorer=eval_card.scorer_info(config), metrics=metrics)


def _write(card: dict[str, Any], output: str | os.PathLike, model: str) -> Path:
    """``output/<UTC time>_<model name>.json`` (a new name when that exists)."""
    from posttrain.trainer.eval_card import write_card

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(model).rstrip("/")).name or "model")
    folder = Path(output).expanduser()
    path, i = folder / f"{stamp}_{name}.json", 1
    while path.exists():
        i += 1
        path = folder / f"{stamp}_{name}_{i}.json"
    return write_card(card, path)


def _check_model_flags(model: str, tokenizer: str | None) -> None:
    """``--model`` / ``--tokenizer`` name a model (or a checkpoint): a `ConfigError` naming the flag otherwise."""
    from posttrain.config import ConfigError
    from posttrain.trainer.preflight import model_path_problem

    for flag, value in (("--model", model), ("--tokenizer", tokenizer)):
        problem = None if value is None or _is_checkpoint(value) else model_path_problem(value)
        if problem is not None:
            raise ConfigError(f"{flag} {value}: {problem}")


def _check_data_flag(data: list[str] | None) -> None:
    """Each ``--data`` file is a prompt file: a `ConfigError` naming the flag otherwise, before anything loads."""
    from posttrain.config import ConfigError
    from posttrain.trainer.preflight import data_file_problem

    for file in data or []:
        problem = data_file_problem(file)
        if problem is not None:
            raise ConfigError(f"--data {problem}")


def _load_tokenizer(config: Any, path: str, tokenizer: str | None) -> Any:
    from posttrain.models import load_tokenizer

    m = config.actor_rollout_ref.model
    return load_tokenizer(tokenizer or path, trust_remote_code=m.trust_remote_code,
                          custom_chat_template=m.custom_chat_template)


def _load_policy(config: Any):
    """(the policy on the run's device in eval mode, the device), loaded as a role is
    (`posttrain.workers.prepare.load_role_model`)."""
    from posttrain.trainer.setup import resolve_device
    from posttrain.workers.prepare import load_role_model

    device = resolve_device(config)
    module = load_role_model("policy", config.actor_rollout_ref.model,
                             config.actor_rollout_ref.actor.fsdp_config.model_dtype).to(device)
    return module.eval(), device


def _engine(config: Any, module: Any, tok: Any, device: Any) -> tuple[Any, str]:
    """(the trainer's rollout engine on ``module``, the precision it computes in): the actor's ``param_dtype``
    (``auto``: decided as for training, `posttrain.workers.prepare.decide_param_dtype`)."""
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
    return engine, param_dtype


def _rows(samples: list[dict], tok: Any, key: str) -> list[dict[str, Any]]:
    """One row per response: data source, prompt id, prompt, response text, ground truth, score."""
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
            rows.append({"data_source": str(out.non_tensor_batch[key][i]), "uid": str(out.non_tensor_batch["uid"][i]),
                         "prompt": prompts[i], "response": texts[i],
                         "ground_truth": out.non_tensor_batch["reward_model"][i].get("ground_truth"),
                         "score": float(score), **({"tool_calls": float(calls[i])} if calls is not None else {})})
    return rows


def _result(model: str, files: Any, length: int, metrics: dict[str, float], rows: list[dict],
            sampling: dict[str, Any]) -> dict[str, Any]:
    """Accuracy (the mean score) per data source and overall, verl's metrics, and the rows."""
    per: dict[str, list[float]] = defaultdict(list)
    prompts: dict[str, set] = defaultdict(set)
    for r in rows:
        per[r["data_source"]].append(r["score"])
        prompts[r["data_source"]].add(r["uid"])
    scores = [r["score"] for r in rows]
    return {
        "model": model,
        "data": files if isinstance(files, list) else [files],
        "max_response_length": length,
        "sampling": sampling,
        "per_source": {s: {"n": len(prompts[s]), "responses": len(v), "accuracy": sum(v) / len(v),
                           **_flexible(metrics, s)} for s, v in sorted(per.items())},
        "overall": {"n": sum(len(u) for u in prompts.values()), "responses": len(scores),
                    "accuracy": sum(scores) / len(scores) if scores else float("nan"), **_tool_use(rows)},
        "metrics": metrics,
        "rows": rows,
    }


def _tool_use(rows: list[dict]) -> dict[str, float]:
    """Multi-turn runs: the share of rows that called a tool at least once."""
    calls = [r["tool_calls"] for r in rows if "tool_calls" in r]
    return {"tool_call_rate": sum(c > 0 for c in calls) / len(calls)} if calls else {}


def _flexible(metrics: dict[str, float], source: str) -> dict[str, float]:
    """The scorer's flexible accuracy (last number in the reply) where it reports one."""
    found = [v for k, v in metrics.items() if re.fullmatch(rf"val-aux/{re.escape(source)}/flexible_acc/mean@\d+", k)]
    return {"flexible_accuracy": found[0]} if len(found) == 1 else {}


def _describe_sampling(s: dict[str, Any], length: int) -> str:
    if not s["do_sample"]:
        asked = f" (val_kwargs.n={s['n_requested']}: one greedy response serves for all)" if s["n_requested"] > 1 else ""
        return f"greedy, 1 response per prompt{asked}, at most {length} new tokens"
    return (f"sampled: {s['n']} responses per prompt, temperature {s['temperature']:g}, top_p {s['top_p']:g}, "
            f"top_k {s['top_k']}, seed {s['seed']}, at most {length} new tokens")


def _metric_lines(metrics: dict[str, float]) -> list[str]:
    """verl's headline metrics (val-core) and the unbiased pass@k, one per line."""
    keys = [k for k in metrics if k.startswith("val-core/")] + [k for k in metrics if "/pass@" in k]
    width = max((len(k) for k in keys), default=0)
    return [f"  {k:<{width}}  {metrics[k]:.4f}" for k in keys]


def format_result(res: dict[str, Any], show: int = 0) -> str:
    width = max([len("data_source"), len("overall")] + [len(s) for s in res["per_source"]])
    lines = [f"model: {res['model']}", f"data: {', '.join(map(str, res['data']))}",
             _describe_sampling(res["sampling"], res["max_response_length"]),
             f"{'data_source':<{width}}  {'n':>6}  {'accuracy':>8}  {'flexible':>8}"]
    for source, v in res["per_source"].items():
        flexible = f"{v['flexible_accuracy']:>8.4f}" if "flexible_accuracy" in v else f"{'-':>8}"
        lines.append(f"{source:<{width}}  {v['n']:>6}  {v['accuracy']:>8.4f}  {flexible}")
    lines.append(f"{'overall':<{width}}  {res['overall']['n']:>6}  {res['overall']['accuracy']:>8.4f}")
    lines.append("metrics (verl's names; pass@k: the unbiased estimator, Chen et al. 2021; all in the card):")
    lines += _metric_lines(res["metrics"])
    if res.get("card_path"):
        lines.append(f"eval card: {res['card_path']}")
    for r in res["rows"][:show]:
        lines.append(f"--- score {r['score']:g} (ground truth {r['ground_truth']}): {r['response']!r}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from posttrain.cli_args import folder_to_write, non_negative_int, positive_float, positive_int, probability

    parser = argparse.ArgumentParser(
        prog="posttrain eval", description="A model or checkpoint on a dataset: verl's mean/best/maj@N and the "
                                           "unbiased pass@k per data source, with an eval card.")
    parser.add_argument("--model", required=True,
                        help="HF folder, .gguf file, smollm2-135m-instruct, hub id, or a checkpoint (global_step_N)")
    parser.add_argument("--data", nargs="+", action="extend", metavar="FILE",
                        help="parquet/jsonl files in verl's schema (default: the built-in run's test split)")
    parser.add_argument("--n", type=positive_int, default=None,
                        help="responses per prompt (actor_rollout_ref.rollout.val_kwargs.n); above 1 on a greedy "
                             "config it samples at temperature 1")
    parser.add_argument("--temperature", type=positive_float, default=None,
                        help="sample at this temperature (val_kwargs.temperature, do_sample=True)")
    parser.add_argument("--top-p", type=probability, default=None, help="nucleus threshold (val_kwargs.top_p)")
    parser.add_argument("--seed", type=non_negative_int, default=None, help="sampling seed (trainer.seed)")
    parser.add_argument("--limit", type=positive_int, default=None, help="evaluate only the first N prompts")
    parser.add_argument("--max-response-length", type=positive_int, default=None,
                        help="new tokens per response (default: data.max_response_length of the built-in config)")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="prompts per generation batch (default: all)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer path when the model folder has none")
    parser.add_argument("--output", type=folder_to_write, default=str(DEFAULT_OUTPUT), metavar="DIR",
                        help=f"folder for the eval card, <UTC time>_<model>.json (default: {DEFAULT_OUTPUT})")
    parser.add_argument("--show", type=non_negative_int, default=0, metavar="K",
                        help="also print the first K responses")
    parser.add_argument("--json", action="store_true", help="print the result (with every response and the card) as JSON")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides (over the built-in config)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    data, overrides = [], list(args.overrides)
    for item in args.data or []:  # `--data a.parquet key=value`: the override is not a file
        (overrides if "=" in item and not Path(item).expanduser().exists() else data).append(item)
    from posttrain.config import ConfigError
    from posttrain.data import DataError
    from posttrain.errors import CheckpointError

    try:
        res = evaluate(args.model, data or None, limit=args.limit, n=args.n, temperature=args.temperature,
                       top_p=args.top_p, seed=args.seed, max_response_length=args.max_response_length,
                       batch_size=args.batch_size, overrides=overrides, tokenizer=args.tokenizer, output=args.output)
    except (ConfigError, DataError, CheckpointError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=1, default=str) if args.json else format_result(res, args.show))
    return 0


if __name__ == "__main__":
    from posttrain.errors import run_cli

    sys.exit(run_cli(main, sys.argv[1:]))
