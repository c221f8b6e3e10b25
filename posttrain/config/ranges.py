"""The valid range of every number in a config tree (RL, SFT, DPO), checked in one pass.

`numeric_problems` walks every int and float key of a dataclass tree (lists of floats too, such as
``optim.betas``) and refuses a value outside the key's declared `Range`, NaN and +-inf included: a
check written as ``value < low`` lets NaN and inf through, so each bound here is tested as
"inside", never as "not outside". A key added to a schema later is covered without being listed:
its range comes from its name (counts >= 1, fractions in [0, 1], everything else >= 0; a negative
default such as verl's -1 is also accepted as "off"/"automatic"), and it is finite whatever it is.
Every time-out (a key whose last part holds "timeout") is > 0 seconds: 0 would mean "no time at all" to
one key and "no limit" to another, so it means neither; a time-out that may be switched off is
Optional and null switches it off.
Keys whose range differs from what their name says are declared in `LEAF_RANGES` (by the last part
of the key) or per tree (`RL_RANGES`, `SFT_RANGES`: full dotted keys).
"""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

__all__ = ["LEAF_RANGES", "RL_RANGES", "SFT_RANGES", "TIMEOUT", "Range", "numeric_keys", "numeric_problems", "range_of"]


@dataclass(frozen=True)
class Range:
    """Finite numbers between ``low`` and ``high`` (None: unbounded on that side); ``off`` is one
    more accepted value (verl's -1), meaning ``off_means``."""

    low: float | None = 0.0
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    off: float | None = None
    off_means: str = "automatic"
    note: str = ""
    """What the number is, appended to the rule ("seconds; ...")."""

    def holds(self, value: float) -> bool:
        if self.off is not None and value == self.off:
            return True
        if not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def text(self) -> str:
        """'>= 0', '> 0', 'in [0, 1)', 'any finite number', plus the accepted 'off' value."""
        low, high = _num(self.low), _num(self.high)
        if self.low is not None and self.high is not None:
            rule = f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        elif self.low is not None:
            rule = f"{'>' if self.low_open else '>='} {low}"
        elif self.high is not None:
            rule = f"{'<' if self.high_open else '<='} {high}"
        else:
            rule = "any finite number"
        rule += f" (or {_num(self.off)}: {self.off_means})" if self.off is not None else ""
        return rule + (f" ({self.note})" if self.note else "")


def _num(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


COUNT = Range(1.0)
TIMEOUT = Range(0.0, low_open=True, note="seconds; 0 would time out at once")
FRACTION = Range(0.0, 1.0)
ANY = Range(None)

LEAF_RANGES: dict[str, Range] = {
    "entropy_coeff": ANY,  # a negative entropy coefficient is a legitimate (if rare) choice
    "clip_cov_lb": ANY, "clip_cov_ub": ANY,  # bounds on a covariance, which may be negative
    "clip_ratio_c": Range(1.0, low_open=True),
    "top_p": Range(0.0, 1.0, low_open=True),
    "betas": Range(0.0, 1.0, high_open=True),
    "gamma": FRACTION, "lam": FRACTION,
    "lr_warmup_steps_ratio": FRACTION, "warmup_steps_ratio": FRACTION, "min_lr_ratio": FRACTION,
    "gpu_memory_utilization": FRACTION, "over_sample_rate": FRACTION,
    "rollout_is_threshold": Range(0.0, low_open=True),
    "train_max_samples": Range(1.0, off=-1, off_means="all"),
    "val_max_samples": Range(1.0, off=-1, off_means="all"),
    "digits": Range(1.0, 18.0),  # the built-in task's operand width: posttrain.data.arithmetic.MAX_DIGITS
}
"""Ranges by a key's last part, in every tree."""

RL_RANGES: dict[str, Range] = {
    "reward.reward_model.nnodes": Range(0.0),  # verl's default 0: no pool of its own
    "reward.timeout_s": Range(0.0, low_open=True, note="seconds; null: no limit"),
    "reward.reward_model.rollout.top_k": Range(1.0, off=-1, off_means="off"),
    "distillation.nnodes": Range(0.0),  # verl's default 0: no teacher pool of its own
    "distillation.n_gpus_per_node": Range(0.0),  # 0 with nnodes 0: the teacher shares the trainer's devices
    "distillation.distillation_loss.log_prob_min_clamp": Range(None, 0.0),  # a log-prob: <= 0
}
"""Ranges by full dotted key of the RL tree (`posttrain.config.schema.PostTrainConfig`)."""

SFT_RANGES: dict[str, Range] = {
    "optim.lr": Range(0.0, low_open=True),
    "optim.lr_warmup_steps_ratio": Range(0.0, 1.0, high_open=True),
    "optim.warmup_steps_ratio": Range(0.0, 1.0, high_open=True),
    "model.lora_alpha": Range(0.0, low_open=True),
    "dpo.beta": Range(0.0, low_open=True),
    "dpo.label_smoothing": Range(0.0, 0.5, high_open=True),
    "data.self_pairs.prompts": COUNT,
    "data.self_pairs.n": Range(2.0, note="a pair needs a correct and a wrong sample"),
    "data.self_pairs.temperature": Range(0.0, low_open=True),
    "data.self_pairs.max_new_tokens": COUNT,
}
"""Ranges by full dotted key of the SFT and DPO trees (`posttrain.config.sft`)."""

# Name rules for keys declared nowhere: counts (sizes, lengths, steps, epochs, ranks) must be >= 1.
_COUNT_WORDS = ("batch_size", "_per_gpu", "max_token_len", "_length", "epochs", "nnodes", "n_gpus_per_node",
                "total_training_steps", "max_consecutive_nonfinite", "parallel_size", "max_num_seqs",
                "max_num_batched_tokens", "horizon", "rollout_n", "max_assistant_turns", "max_parallel_calls",
                "n_train", "n_test", "digits", "num_cpus", "max_concurrent", "memory_limit_mb", "fsdp_size",
                "max_model_len")
_COUNT_NAMES = ("n",)


def range_of(key: str, default: Any, declared: Mapping[str, Range] = RL_RANGES) -> Range:
    """The declared range of ``key`` (full key, then its last part), else the range its name implies;
    a negative number as the default is accepted as that key's 'off' value."""
    leaf = key.rsplit(".", 1)[-1]
    if key in declared:
        return declared[key]
    if leaf in LEAF_RANGES:
        return LEAF_RANGES[leaf]
    if "timeout" in leaf:
        return TIMEOUT
    counted = leaf in _COUNT_NAMES or any(word in leaf for word in _COUNT_WORDS)
    off = default if _is_number(default) and default < 0 else None
    return Range(1.0 if counted else 0.0, off=off, off_means="off" if "freq" in leaf else "automatic")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numeric_base(hint: Any) -> tuple[type | None, bool]:
    """(int or float, whether a list of them) for a numeric leaf's type hint (Optional unwrapped)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        hint = args[0]
    if typing.get_origin(hint) is list:
        inner = typing.get_args(hint)
        return (inner[0], True) if inner and inner[0] in (int, float) else (None, False)
    return (hint, False) if hint in (int, float) else (None, False)


def numeric_keys(root: type) -> list[tuple[str, Any, bool]]:
    """(key, default, is a list) of every int/float leaf of the tree under ``root``, in schema order."""
    from posttrain.config.docs import all_keys, leaf_type

    out = []
    for key, info in all_keys(root).items():
        if not info.is_section:
            base, is_list = _numeric_base(leaf_type(key, root))
            if base is not None:
                out.append((key, info.default, is_list))
    return out


def named_keys(messages: Iterable[str]) -> set[str]:
    """Keys that messages already name (``key=value`` or ``key: why``), so each key is reported once."""
    return {m.group(1) for text in messages for m in re.finditer(r"(?:^|[\s(,])([\w.]+)(?:=|: )", text)}


def numeric_problems(config: Any, root: type, declared: Mapping[str, Range], skip: Iterable[str] = ()) -> list[str]:
    """One line per number of ``config`` outside its range: ``optim.lr=inf must be a finite number > 0``.
    Keys in ``skip`` (already reported by another check) are left out; a key whose default follows
    another key (``${data.train_batch_size}``) and still equals it is checked there."""
    skip, out = set(skip), []
    for key, default, is_list in numeric_keys(root):
        value = get_key(config, key)
        if key in skip or value is None:
            continue
        if isinstance(default, str) and default.startswith("${") and _follows(config, default, value):
            continue
        allowed = range_of(key, default, declared)
        values = list(value) if is_list and isinstance(value, (list, tuple)) else [value]
        if all(not _is_number(v) or allowed.holds(v) for v in values):
            continue
        finite = all(not _is_number(v) or math.isfinite(v) for v in values)
        what = ("hold numbers " if is_list else "be ") if finite else ("hold finite numbers " if is_list
                                                                       else "be a finite number ")
        out.append(f"{key}={value!r} must {what}{allowed.text()}")
    return out


def get_key(config: Any, key: str) -> Any:
    """The value at dotted ``key`` of a loaded config."""
    for part in key.split("."):
        config = getattr(config, part)
    return config


def _follows(config: Any, reference: str, value: Any) -> bool:
    try:
        followed = get_key(config, reference[2:-1])
    except AttributeError:
        return False
    both_nan = _is_number(value) and _is_number(followed) and math.isnan(value) and math.isnan(followed)
    return followed == value or both_nan  # NaN is not equal to itself, but it still followed the key
