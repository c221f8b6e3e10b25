"""``posttrain prep``: turn raw datasets into prompt parquet files in verl's RL schema.

    posttrain prep gsm8k --input ../shared/data/gsm8k --output ~/data/gsm8k
    posttrain prep math --input math_train.jsonl --output ~/data/math
    posttrain prep arithmetic --output ~/data/arithmetic --digits 2 --ops + --n-train 2048
    posttrain prep pairs --input ~/data/arithmetic/train.parquet --model smollm2-135m-instruct \
        --output ~/data/arithmetic/pairs.parquet      # DPO pairs from the model's samples (posttrain.commands.pairs)

GSM8K and MATH rows match verl's ``examples/data_preprocess`` scripts (same data_source, prompt
text, ground truth and extra_info), so files made here and there are interchangeable.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, Callable

from posttrain.cli_args import folder_to_read, int_from_to, non_negative_int, positive_int
from posttrain.data import arithmetic
from posttrain.data.schema import DataError, read_rows, write_rows
from posttrain.host.disk import folder_problem
from posttrain.rewards.latex import last_boxed_answer

__all__ = ["main", "gsm8k_rows", "math_rows", "GSM8K_INSTRUCTION", "MATH_INSTRUCTION"]

GSM8K_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_rows(records: list[dict], split: str, where: str = "gsm8k") -> list[dict]:
    """GSM8K records (``question``, ``answer``) -> rows; ground truth = number after ``#### `` without commas.
    Each row also holds ``messages`` (the question and its worked answer, verl's SFT layout), so one file
    trains both SFT (``data.messages_key=messages``) and RL."""
    rows = []
    for i, rec in enumerate(records):
        for field in ("question", "answer"):
            if not isinstance(rec.get(field), str):
                raise DataError(f"{where} row {i}: missing string field {field!r}")
        m = _GSM8K_ANSWER.search(rec["answer"])
        if m is None:
            raise DataError(f"{where} row {i}: field 'answer' has no '#### <number>' line")
        rows.append(
            {
                "data_source": GSM8K_SOURCE,
                "prompt": [{"role": "user", "content": rec["question"] + " " + GSM8K_INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": m.group(1).replace(",", "")},
                "extra_info": {"split": split, "index": i, "answer": rec["answer"], "question": rec["question"]},
                # verl's gsm8k_multiturn_sft.py layout: the same rows train SFT (data.messages_key=messages)
                "messages": [{"role": "user", "content": rec["question"] + " " + GSM8K_INSTRUCTION},
                             {"role": "assistant", "content": rec["answer"]}],
            }
        )
    return rows


def math_rows(records: list[dict], split: str, where: str = "math") -> tuple[list[dict], list[int]]:
    """MATH records (``problem``, ``solution``) -> (rows, indices skipped for having no boxed answer)."""
    rows, skipped = [], []
    for i, rec in enumerate(records):
        for field in ("problem", "solution"):
            if not isinstance(rec.get(field), str):
                raise DataError(f"{where} row {i}: missing string field {field!r}")
        answer = last_boxed_answer(rec["solution"])
        if answer is None:
            skipped.append(i)
            continue
        rows.append(
            {
                "data_source": MATH_SOURCE,
                "prompt": [{"role": "user", "content": rec["problem"] + " " + MATH_INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows, skipped


def _split_name(path: str) -> str:
    stem = os.path.basename(path).split(".")[0]
    return stem if stem else "train"


def _prep_gsm8k(args) -> int:
    if args.input:
        splits = {}
        for split in ("train", "test"):
            path = os.path.join(os.path.expanduser(args.input), f"{split}.jsonl")
            if not os.path.exists(path):
                raise DataError(f"{path}: file not found (gsm8k --input needs train.jsonl and test.jsonl)")
            splits[split] = (read_rows(path), path)
    else:
        try:
            import datasets
        except ImportError:
            raise DataError(
                "gsm8k: no --input given and the 'datasets' package is not installed; pass --input DIR "
                "with train.jsonl/test.jsonl (e.g. ../shared/data/gsm8k)"
            ) from None
        ds = datasets.load_dataset("openai/gsm8k", "main")
        splits = {s: (list(ds[s]), f"openai/gsm8k:{s}") for s in ("train", "test")}
    for split, (records, where) in splits.items():
        out = os.path.join(os.path.expanduser(args.output), f"{split}.parquet")
        write_rows(gsm8k_rows(records, split, where), out)
        print(f"wrote {len(records)} rows to {out}")
    return 0


def _prep_math(args) -> int:
    src = os.path.expanduser(args.input)
    if os.path.isdir(src):
        inputs = [
            os.path.join(src, f)
            for f in sorted(os.listdir(src))
            if f.split(".")[0] in ("train", "test") and f.endswith((".jsonl", ".json", ".parquet"))
        ]
        if not inputs:
            raise DataError(f"{src}: no train/test .jsonl/.json/.parquet files in this directory")
    else:
        inputs = [src]
    out_dir = os.path.expanduser(args.output or (src if os.path.isdir(src) else os.path.dirname(src) or "."))
    for path in inputs:
        split = args.split or _split_name(path)
        rows, skipped = math_rows(read_rows(path), split, path)
        out = os.path.join(out_dir, f"{split}.parquet")
        if os.path.abspath(out) == os.path.abspath(path):
            raise DataError(f"{path}: output would overwrite the input; pass --output DIR")
        write_rows(rows, out)
        note = f" (skipped {len(skipped)} without a \\boxed answer: rows {skipped[:10]})" if skipped else ""
        print(f"wrote {len(rows)} rows to {out}{note}")
    return 0


def _prep_arithmetic(args) -> int:
    refused = arithmetic.too_few_questions(args.n_train, args.n_test, args.digits, tuple(args.ops))
    if refused:
        raise DataError(refused)
    train, test = arithmetic.write_arithmetic_parquet(
        os.path.expanduser(args.output),
        n_train=args.n_train,
        n_test=args.n_test,
        digits=args.digits,
        ops=tuple(args.ops),
        seed=args.seed,
        prompt_style=args.prompt_style,
    )
    print(f"wrote {args.n_train} rows to {train} and {args.n_test} rows to {test}")
    return 0


def _check_output(args: argparse.Namespace) -> None:
    """``--output`` of the right kind before any work: a folder for the datasets (train/test files go
    into it), a file for ``pairs``."""
    output = getattr(args, "output", None)
    if not output:
        return
    path = os.path.expanduser(output)
    if args.output_kind == "folder":
        blocked = folder_problem(path)
        if blocked:
            raise DataError(f"--output {output}: {blocked}; prep {args.dataset} writes train.parquet and "
                            "test.parquet into a folder: give a new or existing folder")
    elif os.path.isdir(path):
        raise DataError(f"--output {output} is a folder; prep {args.dataset} writes one file: give a file name "
                        "ending in .parquet or .jsonl")
    elif folder_problem(os.path.dirname(os.path.abspath(path))):
        raise DataError(f"--output {output}: {folder_problem(os.path.dirname(os.path.abspath(path)))}; "
                        "give a file in a folder")


def build_parser(*more: Callable[[Any], None]) -> argparse.ArgumentParser:
    """The data room's preparations; each of ``more`` adds sub-commands that need rooms above data
    (`posttrain.commands.prep` adds ``pairs``, which loads a model)."""
    ap = argparse.ArgumentParser(prog="posttrain prep", description="Write prompt parquet files in verl's RL schema.")
    sub = ap.add_subparsers(dest="dataset", required=True)

    g = sub.add_parser("gsm8k", help="GSM8K (openai/gsm8k) -> train.parquet, test.parquet")
    g.add_argument("--input", type=folder_to_read("a folder with train.jsonl and test.jsonl"),
                   help="directory with train.jsonl and test.jsonl (default: download with `datasets`)")
    g.add_argument("--output", required=True, help="output directory")
    g.set_defaults(func=_prep_gsm8k, output_kind="folder")

    m = sub.add_parser("math", help="MATH-style problems with \\boxed{} solutions -> parquet")
    m.add_argument("--input", required=True, help="a .jsonl/.json/.parquet file, or a directory with train/test files")
    m.add_argument("--output", help="output directory (default: beside the input)")
    m.add_argument("--split", help="split name for a single input file (default: its file name, e.g. 'train')")
    m.set_defaults(func=_prep_math, output_kind="folder")

    a = sub.add_parser("arithmetic", help="the built-in arithmetic task -> train.parquet, test.parquet")
    a.add_argument("--output", required=True, help="output directory")
    a.add_argument("--n-train", type=positive_int, default=128)
    a.add_argument("--n-test", type=positive_int, default=64)
    a.add_argument("--digits", type=int_from_to(1, arithmetic.MAX_DIGITS), default=1, help="operand width")
    a.add_argument("--ops", default="+-*", help="operators to use, e.g. '+' or '+-*'")
    a.add_argument("--seed", type=non_negative_int, default=0)
    a.add_argument("--prompt-style", default=arithmetic.DEFAULT_PROMPT_STYLE, choices=list(arithmetic.PROMPT_STYLES))
    a.set_defaults(func=_prep_arithmetic, output_kind="folder")

    from posttrain.data.prep_sft import add_parsers  # SFT rows (worked answers)

    for add in (*more, add_parsers):
        add(sub)
    return ap


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """Run one preparation (``parser``: `build_parser`'s by default); returns 0, or 2 with the error
    printed for bad input."""
    args = (parser or build_parser()).parse_args(argv)
    try:
        _check_output(args)
        return args.func(args)
    except (DataError, ValueError) as e:
        print(f"posttrain prep {args.dataset}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from posttrain.errors import run_cli

    raise SystemExit(run_cli(main, sys.argv[1:]))
