"""``posttrain prep pairs``: preference pairs from a model's own samples, scored by a rule reward.

    posttrain prep arithmetic --output ~/data/arithmetic
    posttrain prep pairs --input ~/data/arithmetic/train.parquet --model smollm2-135m-instruct \\
        --output ~/data/arithmetic/pairs.parquet --n 8 --temperature 1.0 --max-new-tokens 64

Each prompt of an RL parquet (verl's schema) gets ``--n`` samples from the model (posttrain's ``hf``
engine); each sample is scored by its ``data_source``'s built-in scorer (or a custom reward
function); a sample is correct when its score (or the scorer's ``--reward-key`` field, e.g.
``flexible_acc``) is at least ``--threshold``. A prompt with a correct and a wrong sample gives a
pair, chosen = a correct reply, rejected = a wrong one (up to ``--pairs-per-prompt`` pairs, each
reply used once; replies that ended with EOS go first, empty ones never). Rows written::

    {"prompt": [messages], "chosen": [{"role": "assistant", "content": ...}],
     "rejected": [{"role": "assistant", "content": ...}], "data_source": ..., "ability": ...,
     "reward_model": {"style": "rule", "ground_truth": ...},
     "extra_info": {"index", "chosen_score", "rejected_score", "chosen_finished", "rejected_finished"}}

which `posttrain.data.preference.PreferenceDataset` reads as conversational pairs. The counts
(prompts, samples, pairs, prompts whose samples were all correct / all wrong) are printed.

The model is loaded and its precision decided as a run's actor is (`posttrain.workers.prepare`).
"""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass
from typing import Any, Sequence

from posttrain.errors import ConfigError, DataError

__all__ = ["PairCounts", "Sample", "add_pairs_parser", "choose_pairs", "sample_pairs", "self_pairs_file"]


@dataclass(frozen=True)
class Sample:
    """One scored reply: its text, score (the value compared with the threshold) and whether it
    ended with EOS (False: cut at ``--max-new-tokens``)."""

    text: str
    score: float
    finished: bool = True


@dataclass
class PairCounts:
    """What ``sample_pairs`` did: prompts, samples, pairs written, prompts with every sample correct
    / every sample wrong / both kinds, and the fraction of samples that were correct."""

    prompts: int = 0
    samples: int = 0
    pairs: int = 0
    all_correct: int = 0
    all_wrong: int = 0
    mixed: int = 0
    correct_samples: int = 0

    def summary(self) -> str:
        accuracy = self.correct_samples / self.samples if self.samples else float("nan")
        return (f"{self.prompts} prompts, {self.samples} samples ({accuracy:.1%} correct): {self.pairs} pairs from "
                f"{self.mixed} prompts with correct and wrong samples; {self.all_correct} prompts all correct, "
                f"{self.all_wrong} all wrong (no pair)")


def choose_pairs(samples: Sequence[Sample], threshold: float, max_pairs: int = 1) -> list[tuple[Sample, Sample]]:
    """``(chosen, rejected)`` pairs of one prompt's samples: correct (``score >= threshold``) against
    wrong replies, distinct texts only, empty replies left out, finished replies first (then in
    sample order), each reply in one pair at most; at most ``max_pairs``."""
    def candidates(correct: bool) -> list[Sample]:
        seen, out = set(), []
        for s in samples:
            if (s.score >= threshold) == correct and s.text.strip() and s.text not in seen:
                seen.add(s.text)
                out.append(s)
        return sorted(out, key=lambda s: not s.finished)  # stable: sample order within each kind

    return list(zip(candidates(True), candidates(False)))[:max_pairs]


def _check_args(n: int, temperature: float, top_p: float, max_new_tokens: int, batch_size: int,
                pairs_per_prompt: int, limit: int | None, max_prompt_length: int) -> None:
    checks = [
        (n >= 2, f"--n {n}: a pair needs at least 2 samples per prompt (one correct, one wrong); 4-16 is typical"),
        (temperature > 0, f"--temperature {temperature}: must be > 0 (greedy decoding gives {n} identical samples)"),
        (0 < top_p <= 1, f"--top-p {top_p}: must be in (0, 1]"),
        (max_new_tokens >= 1, f"--max-new-tokens {max_new_tokens}: must be >= 1"),
        (batch_size >= 1, f"--batch-size {batch_size}: must be >= 1 (prompts per generation batch)"),
        (pairs_per_prompt >= 1, f"--pairs-per-prompt {pairs_per_prompt}: must be >= 1"),
        (limit is None or limit >= 1, f"--limit {limit}: must be >= 1 (or left out for every prompt)"),
        (max_prompt_length >= 1, f"--max-prompt-length {max_prompt_length}: must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _check_output(output: str) -> None:
    if not output.endswith((".parquet", ".jsonl")):
        raise ConfigError(f"--output {output}: give a .parquet or .jsonl file name")


def _check_scorers(rows: list[dict], reward_fn_key: str, custom: bool, where: str) -> None:
    """Every data_source has a built-in scorer (or a custom function scores them all): checked before
    the model loads, not after generating."""
    from posttrain.rewards import KNOWN_DATA_SOURCES

    if custom:
        return
    unknown = sorted({str(r.get(reward_fn_key)) for r in rows} - set(KNOWN_DATA_SOURCES))
    if unknown:
        raise DataError(f"{where}: no built-in reward for {reward_fn_key}={unknown}; known: {list(KNOWN_DATA_SOURCES)}."
                        " Pass --reward-path FILE (and --reward-name) to score other data")


def sample_pairs(model: str, data: str, *, n: int = 8, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 256, batch_size: int = 16, threshold: float = 1.0, reward_key: str = "score",
                 pairs_per_prompt: int = 1, limit: int | None = None, max_prompt_length: int = 1024,
                 reward_path: str | None = None, reward_name: str = "compute_score", param_dtype: str = "auto",
                 seed: int = 0, tokenizer: str | None = None) -> tuple[list[dict], PairCounts]:
    """Generate ``n`` samples per prompt of ``data`` with ``model``, score them, pair them (module
    docstring); returns ``(rows, counts)``. ``model``: a Hugging Face folder, ``.gguf`` file, the
    ``smollm2-135m-instruct`` alias, a hub id or a posttrain checkpoint (as ``posttrain eval``)."""
    import torch

    from posttrain.config.schema import DataConfig
    from posttrain.models import autocast_context, default_device
    from posttrain.rewards import RewardManager, load_custom_reward_fn
    from posttrain.rollout import SamplingParams, get_rollout_engine
    from posttrain.workers.prepare import decide_param_dtype

    _check_args(n, temperature, top_p, max_new_tokens, batch_size, pairs_per_prompt, limit, max_prompt_length)
    config = DataConfig(max_prompt_length=max_prompt_length, return_raw_chat=True)
    compute_score = load_custom_reward_fn(reward_path, reward_name) if reward_path else None
    device = default_device()
    tok, dataset, module = _load(model, tokenizer, data, config, limit, compute_score is not None, device)
    dtype = decide_param_dtype(param_dtype, module, device)
    engine = get_rollout_engine("hf", model=module, tokenizer=tok, autocast=functools.partial(autocast_context, device,
                                                                                               dtype))
    sampling = SamplingParams(n=n, temperature=temperature, top_p=top_p, response_length=max_new_tokens,
                              calculate_log_probs=False)
    scorer = RewardManager(tok, compute_score=compute_score, reward_fn_key=config.reward_fn_key)
    torch.manual_seed(seed)
    rows, counts = [], PairCounts()
    try:
        for start in range(0, len(dataset), batch_size):
            prompts = dataset.collate_fn([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
            with torch.no_grad():
                out = engine.generate(prompts, sampling)
            samples = _samples(out, _scores(scorer, out, reward_key), tok, engine.eos_token_ids)
            _pair_prompts(out, samples, n, threshold, pairs_per_prompt, rows, counts)
    finally:
        scorer.close()
    return rows, counts


def _load(model: str, tokenizer: str | None, data: str, config, limit: int | None, custom_reward: bool, device):
    """``(tokenizer, prompt dataset, model)``: the model path checked, then the prompts read and their
    scorers checked, then the weights loaded (so bad input fails before the slow part)."""
    from posttrain.config.actor_rollout_ref import ActorModelConfig
    from posttrain.data.rl_dataset import RLHFDataset
    from posttrain.models import load_tokenizer
    from posttrain.trainer.evaluate import resolve_model
    from posttrain.trainer.preflight import model_path_problem
    from posttrain.workers.prepare import load_role_model

    with resolve_model(model) as path:
        problem = model_path_problem(path)
        if problem is not None:
            raise ConfigError(f"--model {model}: {problem}")
        tok = load_tokenizer(tokenizer or path)
        dataset = RLHFDataset(data, tok, config)
        if limit is not None:
            dataset.rows, dataset.input_ids = dataset.rows[:limit], dataset.input_ids[:limit]
        _check_scorers(dataset.rows, config.reward_fn_key, custom_reward, data)
        module = load_role_model("policy", ActorModelConfig(path=path), model_dtype="fp32")  # as an actor loads
        return tok, dataset, module.to(device).eval()


def _scores(scorer, out, reward_key: str) -> list[float]:
    """Each row's reward (its summed token-level score), or the scorer's ``reward_key`` field."""
    token_scores, extra = scorer(out)
    if reward_key == "score":
        return token_scores.sum(-1).tolist()
    if reward_key not in extra:
        fields = sorted(k for k in extra if not k.startswith("reward/")) or ["(none: the scorer returns a number)"]
        raise ConfigError(f"--reward-key {reward_key}: the scorer returns no such field; its fields: {fields}")
    return [float(v) for v in extra[reward_key]]


def _samples(out, scores: list[float], tok, eos_token_ids: list[int]) -> list[Sample]:
    """The generated rows as scored samples; ``finished``: the reply's last token is an EOS."""
    mask = out["response_mask"].bool()
    ids = [r[m].tolist() for r, m in zip(out["responses"], mask)]
    texts = tok.batch_decode(ids, skip_special_tokens=True)
    return [Sample(text, score, bool(row) and row[-1] in eos_token_ids) for text, score, row in zip(texts, scores, ids)]


def _pair_prompts(out, samples: list[Sample], n: int, threshold: float, pairs_per_prompt: int, rows: list[dict],
                  counts: PairCounts) -> None:
    """Pair the ``n`` consecutive samples of each prompt of a generated batch into ``rows``."""
    for first in range(0, len(samples), n):
        group = samples[first:first + n]
        correct = sum(s.score >= threshold for s in group)
        counts.prompts += 1
        counts.samples += n
        counts.correct_samples += correct
        counts.all_correct += correct == n
        counts.all_wrong += correct == 0
        pairs = choose_pairs(group, threshold, pairs_per_prompt)
        counts.mixed += 0 < correct < n
        counts.pairs += len(pairs)
        rows.extend(_pair_row(out.non_tensor_batch, first, chosen, rejected) for chosen, rejected in pairs)


def _pair_row(nt: dict, k: int, chosen: Sample, rejected: Sample) -> dict[str, Any]:
    extra = nt["extra_info"][k] if "extra_info" in nt and nt["extra_info"][k] else {}
    row = {
        "prompt": [dict(m) for m in nt["raw_prompt"][k]],
        "chosen": [{"role": "assistant", "content": chosen.text}],
        "rejected": [{"role": "assistant", "content": rejected.text}],
        "data_source": nt["data_source"][k],
        "reward_model": dict(nt["reward_model"][k]),
        "extra_info": {"index": extra.get("index", nt["index"][k] if "index" in nt else None),
                       "chosen_score": chosen.score, "rejected_score": rejected.score,
                       "chosen_finished": chosen.finished, "rejected_finished": rejected.finished},
    }
    if "ability" in nt and nt["ability"][k] is not None:
        row["ability"] = nt["ability"][k]
    return row


# ------------------------------------------------------------------------------------------------
# the built-in DPO run's pairs (a DPO run with data.train_files null)


def self_pairs_file(config: Any) -> str:
    """The pairs file of a DPO run without ``data.train_files``: ``model.partial_pretrain``'s own samples on the
    built-in arithmetic task's training prompts (``data.arithmetic.*``), paired as `posttrain prep pairs` pairs
    them (``data.self_pairs.*``), as examples/dpo_smollm2_arithmetic.sh does. Sampled once, then read from
    posttrain's cache (keyed by the model and every knob), so a resumed run trains on the same pairs."""
    from posttrain.data.arithmetic import default_dataset_files
    from posttrain.data.schema import write_rows

    task, knobs = config.data.arithmetic, config.data.self_pairs
    prompts, _ = default_dataset_files(digits=task.digits, ops=("+",), n_train=task.n_train, n_test=task.n_test,
                                       seed=task.seed, prompt_style=task.prompt_style)
    model = str(config.model.partial_pretrain)
    dtype = config.model.fsdp_config.mixed_precision.param_dtype
    out = _self_pairs_path(model, prompts, knobs, dtype, config.trainer.seed)
    if out.exists():
        print(f"DPO pairs: {out} (the model's own samples, drawn by an earlier run)", flush=True)
        return str(out)
    print(f"DPO pairs: sampling {knobs.n} replies to each of {knobs.prompts} prompts of the built-in task from {model} "
          f"(data.train_files is null: the model's own pairs, data.self_pairs.*)", flush=True)
    rows, counts = sample_pairs(model, prompts, n=knobs.n, temperature=knobs.temperature,
                                max_new_tokens=knobs.max_new_tokens, batch_size=knobs.batch_size,
                                reward_key=knobs.reward_key, limit=knobs.prompts, param_dtype=dtype,
                                seed=config.trainer.seed)
    print(f"DPO pairs: {counts.summary()}", flush=True)
    if not rows:
        raise DataError(f"{model}'s samples gave no pair (no prompt had both a correct and a wrong reply): raise "
                        "data.self_pairs.n, data.self_pairs.temperature or data.self_pairs.prompts, or give "
                        "data.train_files (pairs from `posttrain prep pairs`)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp_{os.getpid()}_{out.name}")
    write_rows(rows, str(tmp))
    os.replace(tmp, out)  # whole or absent: a killed sampling leaves no half file to be read next time
    print(f"DPO pairs: wrote {len(rows)} pairs to {out}", flush=True)
    return str(out)


def _self_pairs_path(model: str, prompts: str, knobs: Any, dtype: str, seed: int):
    """Where the pairs of these settings are cached: a local model folder's weights count by their files'
    sizes and times, so a model trained in place is sampled again."""
    import hashlib
    import json
    from dataclasses import asdict
    from pathlib import Path

    from posttrain.host.cache import cache_root

    local = Path(model).expanduser()
    files = sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in local.rglob("*") if p.is_file()) \
        if local.is_dir() else []
    key = json.dumps([model, files, prompts, asdict(knobs), dtype, seed], default=str)
    return cache_root() / "dpo_pairs" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.parquet"


# ------------------------------------------------------------------------------------------------
# command line (`posttrain prep pairs`, added to posttrain.data.prep's parser by posttrain.commands.prep)


def add_pairs_parser(sub) -> None:
    """Add the ``pairs`` sub-command to ``posttrain prep``'s sub-parsers."""
    from posttrain.cli_args import (file_to_read, finite_float, int_at_least, non_negative_int, positive_float,
                                    positive_int, probability)

    p = sub.add_parser("pairs", help="preference pairs from a model's own samples, scored by the rule reward",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--input", type=file_to_read("a prompt file (.parquet or .jsonl)"), required=True,
                   help="prompt parquet/jsonl in verl's RL schema (e.g. from prep gsm8k)")
    p.add_argument("--model", required=True,
                   help="HF folder, .gguf file, smollm2-135m-instruct, hub id, or a checkpoint (global_step_N)")
    p.add_argument("--output", required=True, help="pairs file to write (.parquet or .jsonl)")
    p.add_argument("--n", type=int_at_least(2), default=8, help="samples per prompt (>= 2)")
    p.add_argument("--temperature", type=positive_float, default=1.0)
    p.add_argument("--top-p", type=probability, default=1.0)
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="most tokens per sample")
    p.add_argument("--batch-size", type=positive_int, default=16, help="prompts per generation batch")
    p.add_argument("--threshold", type=finite_float, default=1.0,
                   help="a sample is correct when its score is at least this (built-in scorers: 1 = right)")
    p.add_argument("--reward-key", default="score",
                   help="the scorer's field compared with --threshold (e.g. flexible_acc for the arithmetic task)")
    p.add_argument("--pairs-per-prompt", type=positive_int, default=1)
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N prompts")
    p.add_argument("--max-prompt-length", type=positive_int, default=1024, help="longer prompts are an error")
    p.add_argument("--reward-path", type=file_to_read("a Python file of reward functions"), default=None,
                   help="custom reward function file (default: built-in scorers)")
    p.add_argument("--reward-name", default="compute_score", help="function name in --reward-path")
    p.add_argument("--param-dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="compute precision of generation (auto: the faster on this machine)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--tokenizer", default=None, help="tokenizer path when the model folder has none")
    p.set_defaults(func=_prep_pairs, output_kind="file")


def _prep_pairs(args: argparse.Namespace) -> int:
    from posttrain.data.schema import write_rows

    output = os.path.expanduser(args.output)
    _check_output(output)
    rows, counts = sample_pairs(
        args.model, os.path.expanduser(args.input), n=args.n, temperature=args.temperature, top_p=args.top_p,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, threshold=args.threshold,
        reward_key=args.reward_key, pairs_per_prompt=args.pairs_per_prompt, limit=args.limit,
        max_prompt_length=args.max_prompt_length, reward_path=args.reward_path, reward_name=args.reward_name,
        param_dtype=args.param_dtype, seed=args.seed, tokenizer=args.tokenizer)
    print(counts.summary())
    if not rows:
        raise DataError(f"{args.input}: no prompt had both a correct and a wrong sample, so there are no pairs to "
                        "write; try more samples (--n), a higher --temperature, more --max-new-tokens, or an easier "
                        "task")
    write_rows(rows, output)
    print(f"wrote {len(rows)} pairs to {output}")
    return 0
