"""SFT rows for the built-in arithmetic task: the RL rows plus the worked answer in ``extra_info``.

Each row keeps verl's RL schema (``prompt`` messages, ``reward_model.ground_truth``, ...) and adds
``extra_info.answer``, a worked solution ending in the ``#### <answer>`` line the scorers read, as
verl's GSM8K files carry it. The same file is then an SFT file (``data.prompt_key=prompt
data.response_key=extra_info data.response_dict_keys=[answer]``), an RL file and an evaluation file.
GSM8K files written by ``posttrain prep gsm8k`` already are (verl's ``extra_info.question`` /
``extra_info.answer``: ``data.prompt_key=extra_info data.prompt_dict_keys=[question]``, or
``data.prompt_key=prompt`` for the prompt with its instruction).

    posttrain prep arithmetic-sft --output ~/data/arithmetic_sft --digits 2 --ops + --n-train 1024
"""

from __future__ import annotations

import os
from typing import Sequence

from posttrain.cli_args import int_from_to, non_negative_int, positive_int
from posttrain.data import arithmetic
from posttrain.data.schema import DataError, write_rows

__all__ = ["add_parsers", "arithmetic_sft_rows", "default_arithmetic_sft_files", "worked_answer"]

SFT_KEYS = ["data.prompt_key=prompt", "data.response_key=extra_info", "data.response_dict_keys=[answer]"]
"""The SFT keys that read these files."""


def worked_answer(problem: arithmetic.Problem) -> str:
    a, op, b = problem
    return f"{a} {op} {b} = {problem.answer}\n#### {problem.answer}"


def arithmetic_sft_rows(problems: Sequence[arithmetic.Problem], split: str,
                        prompt_style: str = arithmetic.DEFAULT_PROMPT_STYLE) -> list[dict]:
    rows = arithmetic.make_rows(problems, split, prompt_style)
    for row, problem in zip(rows, problems):
        row["extra_info"]["answer"] = worked_answer(problem)
    return rows


def write_arithmetic_sft(out_dir: str, n_train: int, n_test: int, digits: int, ops: Sequence[str] = ("+",),
                         seed: int = 0, prompt_style: str = arithmetic.DEFAULT_PROMPT_STYLE) -> tuple[str, str]:
    train, test = arithmetic.generate_problems(n_train, n_test, digits, tuple(ops), seed)
    paths = (os.path.join(out_dir, "train.parquet"), os.path.join(out_dir, "test.parquet"))
    write_rows(arithmetic_sft_rows(train, "train", prompt_style), paths[0])
    write_rows(arithmetic_sft_rows(test, "test", prompt_style), paths[1])
    return paths


def default_arithmetic_sft_files(digits: int = 2, n_train: int = 1024, n_test: int = 128, seed: int = 0,
                                 ops: Sequence[str] = ("+",), prompt_style: str = "fewshot") -> tuple[str, str]:
    """(train, test) of the built-in SFT data, written once into ``arithmetic_sft/`` of posttrain's cache
    folder (``~/.cache/posttrain``, or ``POSTTRAIN_CACHE_DIR``). The same problems as the RL built-in task
    with the same knobs (`arithmetic.generate_problems`)."""
    from posttrain.host.cache import cache_root

    ops_tag = "".join({"+": "add", "-": "sub", "*": "mul"}[o] for o in ops)
    tag = f"d{digits}_{ops_tag}_tr{n_train}_te{n_test}_s{seed}_{prompt_style}"
    out_dir = os.path.join(os.path.expanduser(cache_root()), "arithmetic_sft", tag)
    train, test = os.path.join(out_dir, "train.parquet"), os.path.join(out_dir, "test.parquet")
    if not (os.path.exists(train) and os.path.exists(test)):
        tmp = f"{out_dir}.tmp{os.getpid()}"
        write_arithmetic_sft(tmp, n_train, n_test, digits, ops, seed, prompt_style)
        os.makedirs(out_dir, exist_ok=True)
        for name in ("train.parquet", "test.parquet"):
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
        os.rmdir(tmp)
    return train, test


def _prep_arithmetic_sft(args) -> int:
    refused = arithmetic.too_few_questions(args.n_train, args.n_test, args.digits, tuple(args.ops))
    if refused:
        raise DataError(refused)
    train, test = write_arithmetic_sft(os.path.expanduser(args.output), args.n_train, args.n_test, args.digits,
                                       tuple(args.ops), args.seed, args.prompt_style)
    print(f"wrote {args.n_train} rows to {train} and {args.n_test} rows to {test}; train on them with\n"
          f"  posttrain sft data.train_files={train} data.val_files={test} {' '.join(SFT_KEYS)}")
    return 0


def add_parsers(sub) -> None:
    """``posttrain prep arithmetic-sft`` (added to `posttrain.data.prep`'s parser)."""
    a = sub.add_parser("arithmetic-sft", help="the built-in arithmetic task with worked answers (SFT + RL rows)")
    a.add_argument("--output", required=True, help="output directory")
    a.add_argument("--n-train", type=positive_int, default=1024)
    a.add_argument("--n-test", type=positive_int, default=128)
    a.add_argument("--digits", type=int_from_to(1, arithmetic.MAX_DIGITS), default=2, help="operand width")
    a.add_argument("--ops", default="+", help="operators to use, e.g. '+' or '+-*'")
    a.add_argument("--seed", type=non_negative_int, default=0)
    a.add_argument("--prompt-style", default=arithmetic.DEFAULT_PROMPT_STYLE, choices=list(arithmetic.PROMPT_STYLES))
    a.set_defaults(func=_prep_arithmetic_sft, output_kind="folder")
