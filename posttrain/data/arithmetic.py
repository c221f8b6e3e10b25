"""The built-in arithmetic task: seeded problems like "What is 47 + 38?" with exact answers.

Rows follow verl's schema with ``data_source="posttrain/arithmetic"`` and the answer as
``reward_model.ground_truth``; the scorer (:mod:`posttrain.rewards.arithmetic`) wants the reply to
end with ``#### <answer>``.

Knobs: ``digits`` (operand width), ``ops`` (any of ``+ - *``), ``n_train``, ``n_test``, ``seed``,
``prompt_style`` (how the question is asked; see :data:`PROMPT_STYLES`). Subtraction puts the
larger operand first, so answers are never negative. Test questions never appear in train; when
the question space is too small for ``n_train`` distinct train questions, train questions repeat.

Defaults (1-digit ``+ - *``, ``fewshot_instruct``, 128 train / 64 test) are the setting where
SmolLM2-135M-Instruct starts at 42% greedy (32% sampled at T=1) but knows most answers (91% with
the plain few-shot prompt): what it lacks is the ``#### N`` habit, which GRPO can teach in minutes.
See ``benchmarks/arithmetic_baseline.py``.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Sequence

from posttrain.data.schema import write_rows

__all__ = [
    "DATA_SOURCE",
    "PROMPT_STYLES",
    "DEFAULT_PROMPT_STYLE",
    "Problem",
    "INSTRUCTION",
    "MAX_DIGITS",
    "demo_problem",
    "question_count",
    "too_few_questions",
    "make_messages",
    "generate_problems",
    "make_rows",
    "write_arithmetic_parquet",
    "default_dataset_files",
]

logger = logging.getLogger(__name__)

DATA_SOURCE = "posttrain/arithmetic"

INSTRUCTION = "End with #### and the answer."

# prompt_style -> what the prompt holds.
PROMPT_STYLES: dict[str, str] = {
    "plain": "the bare question",
    "instruct": "the question and INSTRUCTION",
    "fewshot": "one worked example turn ('31 + 45 = 76\\n#### 76'), then the bare question",
    "fewshot_instruct": "the same example turn, with INSTRUCTION after each question",
    "retry": ("fewshot_instruct's prompt, and rows that ask the 'arithmetic' interaction to judge each answer "
              "(extra_info.interaction_kwargs): a wrong one gets 'try again' (multi-turn)"),
    "tool": ("the multi-turn task: a system message describing the calculator tool, one worked example "
             "(a call, its <tool_response>, the answer) on (digits+1)-digit numbers, then the question"),
}
DEFAULT_PROMPT_STYLE = "fewshot_instruct"

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

MAX_DIGITS = 18
"""The widest operand: a random.choice over 10**18 numbers is the largest Python's range() draws from
(19 digits overflow it), far beyond what a model learns to add (`posttrain.config.ranges` holds the same bound
for data.arithmetic.digits)."""


class Problem(tuple):
    """``(a, op, b)`` with ``.question`` and ``.answer``."""

    __slots__ = ()

    def __new__(cls, a: int, op: str, b: int):
        if op == "-" and b > a:
            a, b = b, a
        return super().__new__(cls, (a, op, b))

    @property
    def question(self) -> str:
        a, op, b = self
        return f"What is {a} {op} {b}?"

    @property
    def answer(self) -> int:
        a, op, b = self
        return _OPS[op](a, b)


def demo_problem(digits: int) -> Problem:
    """The worked example shown by the few-shot styles (3 + 4, 31 + 45, 311 + 455, ...); it is never
    generated as a train or test question."""
    return Problem(int("3" + "1" * (digits - 1)), "+", int("4" + "5" * (digits - 1)))


def _operand_range(digits: int) -> range:
    if not 1 <= digits <= MAX_DIGITS:
        raise ValueError(f"digits must be a whole number from 1 to {MAX_DIGITS}, got {digits}")
    return range(1 if digits == 1 else 10 ** (digits - 1), 10**digits)


def _check_ops(ops: Sequence[str]) -> list[str]:
    ops = list(dict.fromkeys(ops))
    bad = [o for o in ops if o not in _OPS]
    if not ops or bad:
        raise ValueError(f"ops must be a non-empty subset of {list(_OPS)}, got {ops}")
    return ops


def _all_problems(digits: int, ops: Sequence[str]) -> list[Problem]:
    r = _operand_range(digits)
    out = {Problem(a, op, b) for op in ops for a in r for b in r}
    out.discard(demo_problem(digits))
    return sorted(out)


def question_count(digits: int, ops: Sequence[str]) -> int:
    """How many distinct questions ``digits``-digit operands and ``ops`` make (the few-shot demo excluded)."""
    k = len(_operand_range(digits))
    ops = _check_ops(ops)
    return sum(k * (k + 1) // 2 if op == "-" else k * k for op in ops) - ("+" in ops)  # minus the demo



def too_few_questions(n_train: int, n_test: int, digits: int, ops: Sequence[str]) -> str | None:
    """Why a prepared file cannot hold ``n_train`` + ``n_test`` distinct questions (a file of repeated rows
    teaches nothing another epoch would not), in `posttrain prep`'s flags; None when it can."""
    space = question_count(digits, ops)
    if n_train + n_test <= space:
        return None
    return (f"--n-train {n_train} + --n-test {n_test} asks for {n_train + n_test:,} distinct questions, but "
            f"{digits}-digit operands with '{''.join(_check_ops(ops))}' make only {space:,} (test questions never "
            f"appear in train): ask for at most {space:,} in all, or more --digits")


def generate_problems(
    n_train: int, n_test: int, digits: int = 1, ops: Sequence[str] = ("+", "-", "*"), seed: int = 0
) -> tuple[list[Problem], list[Problem]]:
    """(train, test) problems; deterministic in all arguments, test questions distinct and not in train."""
    for name, value, least in (("n_train", n_train, 0), ("n_test", n_test, 0), ("digits", digits, 1)):
        if value < least:  # a negative count would slice rows off the end
            raise ValueError(f"{name}={value!r} must be a whole number >= {least}")
    ops = _check_ops(ops)
    rng = random.Random(f"posttrain-arithmetic-{digits}-{''.join(ops)}-{seed}")
    space = question_count(digits, ops)
    if n_test > space:
        raise ValueError(f"n_test={n_test} exceeds the {space} distinct {digits}-digit {ops} questions")
    if space <= 200_000:
        pool = _all_problems(digits, ops)
        rng.shuffle(pool)
        test, rest = pool[:n_test], pool[n_test:]
    else:
        r = _operand_range(digits)
        seen: set[Problem] = {demo_problem(digits)}
        test = []
        while len(test) < n_test:
            p = Problem(rng.choice(r), rng.choice(ops), rng.choice(r))
            if p not in seen:
                seen.add(p)
                test.append(p)
        rest = None
    if rest is not None:
        if not rest and n_train:
            raise ValueError(f"no questions left for train: n_test={n_test} uses all {space}")
        if n_train <= len(rest):
            train = rest[:n_train]
        else:
            logger.warning("only %d distinct train questions for n_train=%d: train repeats", len(rest), n_train)
            train = [rest[i % len(rest)] for i in range(n_train)]
            rng.shuffle(train)
    else:
        banned = set(test) | {demo_problem(digits)}
        train = []
        while len(train) < n_train:
            p = Problem(rng.choice(r), rng.choice(ops), rng.choice(r))
            if p not in banned:
                banned.add(p)
                train.append(p)
    return train, test


TOOL_SYSTEM = ("You have a calculator. Call it by writing\n"
               '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>\n'
               "and read its result. " + INSTRUCTION)


def tool_messages(problem: Problem) -> list[dict[str, str]]:
    """The ``tool`` style's prompt: the calculator described, one worked call on (digits+1)-digit
    numbers of the problem's operator (never a generated question), then the question. The example's
    tool answer is written as the multi-turn loop renders one for a template without a tool role."""
    digits = len(str(problem[0]))
    demo = Problem(int("3" + "1" * digits), problem[1], int("4" + "5" * digits))
    a, op, b = demo
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%d %s %d"}}</tool_call>' % (a, op, b)
    return [
        {"role": "system", "content": TOOL_SYSTEM},
        {"role": "user", "content": demo.question},
        {"role": "assistant", "content": call},
        {"role": "user", "content": f"<tool_response>\n{demo.answer}\n</tool_response>"},
        {"role": "assistant", "content": f"{a} {op} {b} = {demo.answer}\n#### {demo.answer}"},
        {"role": "user", "content": problem.question},
    ]


def make_messages(problem: Problem, prompt_style: str = DEFAULT_PROMPT_STYLE) -> list[dict[str, str]]:
    """The chat prompt for one problem in ``prompt_style`` (see :data:`PROMPT_STYLES`)."""
    if prompt_style not in PROMPT_STYLES:
        raise ValueError(f"prompt_style={prompt_style!r}; expected one of {list(PROMPT_STYLES)}")
    if prompt_style == "tool":
        return tool_messages(problem)
    suffix = " " + INSTRUCTION if prompt_style in ("instruct", "fewshot_instruct", "retry") else ""
    messages = []
    if prompt_style.startswith("fewshot") or prompt_style == "retry":
        demo = demo_problem(len(str(problem[0])))
        a, op, b = demo
        messages += [
            {"role": "user", "content": demo.question + suffix},
            {"role": "assistant", "content": f"{a} {op} {b} = {demo.answer}\n#### {demo.answer}"},
        ]
    return messages + [{"role": "user", "content": problem.question + suffix}]


def make_rows(problems: Sequence[Problem], split: str, prompt_style: str = DEFAULT_PROMPT_STYLE) -> list[dict]:
    """Rows in verl's schema."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": make_messages(p, prompt_style),
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"split": split, "index": i, "question": p.question,
                           **({"interaction_kwargs": {"name": "arithmetic", "ground_truth": str(p.answer)}}
                              if prompt_style == "retry" else {})},
        }
        for i, p in enumerate(problems)
    ]


def write_arithmetic_parquet(
    out_dir: str,
    n_train: int = 128,
    n_test: int = 64,
    digits: int = 1,
    ops: Sequence[str] = ("+", "-", "*"),
    seed: int = 0,
    prompt_style: str = DEFAULT_PROMPT_STYLE,
) -> tuple[str, str]:
    """Write ``train.parquet`` and ``test.parquet`` into ``out_dir``; return their paths."""
    train, test = generate_problems(n_train, n_test, digits, ops, seed)
    paths = (os.path.join(out_dir, "train.parquet"), os.path.join(out_dir, "test.parquet"))
    write_rows(make_rows(train, "train", prompt_style), paths[0])
    write_rows(make_rows(test, "test", prompt_style), paths[1])
    return paths


def default_dataset_files(cache_dir: str | None = None, **knobs) -> tuple[str, str]:
    """(train, test) parquet paths of the built-in task, written once into a cache directory keyed by
    the knobs (default ``arithmetic/`` in posttrain's cache folder: ``~/.cache/posttrain``, or
    ``POSTTRAIN_CACHE_DIR``). For the trainer when no data files are given."""
    from posttrain.host.cache import cache_root

    cache_dir = os.path.expanduser(cache_dir or os.path.join(cache_root(), "arithmetic"))
    params = dict(n_train=128, n_test=64, digits=1, ops=("+", "-", "*"), seed=0, prompt_style=DEFAULT_PROMPT_STYLE)
    unknown = set(knobs) - set(params)
    if unknown:
        raise TypeError(f"unknown arithmetic knob(s) {sorted(unknown)}; known: {sorted(params)}")
    params.update(knobs)
    tag = "d{digits}_{ops}_tr{n_train}_te{n_test}_s{seed}_{prompt_style}".format(
        **{**params, "ops": "".join({"+": "add", "-": "sub", "*": "mul"}[o] for o in params["ops"])}
    )
    out_dir = os.path.join(cache_dir, tag)
    train, test = os.path.join(out_dir, "train.parquet"), os.path.join(out_dir, "test.parquet")
    if not (os.path.exists(train) and os.path.exists(test)):
        tmp = f"{out_dir}.tmp{os.getpid()}"
        write_arithmetic_parquet(tmp, **params)
        os.makedirs(out_dir, exist_ok=True)
        for name in ("train.parquet", "test.parquet"):
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
        os.rmdir(tmp)
    return train, test
