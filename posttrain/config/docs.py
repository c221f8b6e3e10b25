"""Walk the config schema: every dotted key with its type, default and one-line doc.

The doc of a field is the string literal right under it in the class body (as in cleanrl's
`Args`), read from the source with `ast`, so each key is documented exactly once.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Iterator

from posttrain.config.schema import PostTrainConfig


@dataclass(frozen=True)
class KeyInfo:
    key: str
    """Full dotted key, e.g. `actor_rollout_ref.rollout.n`."""
    type: str
    """Type as written in the schema."""
    default: Any
    """Default value (an interpolation string `${...}` where the key follows another)."""
    doc: str
    """One-line meaning."""
    is_section: bool
    """True for a node that holds other keys."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: doc string under it} for a dataclass, from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def section_class(hint: Any) -> type | None:
    """The dataclass a field holds, or None for a leaf (Optional[...] unwrapped)."""
    if dataclasses.is_dataclass(hint):
        return hint  # type: ignore[return-value]
    return None


def iter_keys(cls: type = PostTrainConfig, prefix: str = "", defaults: Any = None) -> Iterator[KeyInfo]:
    """Every key below `cls`, sections first then their children, in schema order.

    Defaults are read from a default-constructed instance, so a section whose parent builds it
    with other values (the critic's optimizer has lr=1e-5) shows those.
    """
    defaults = cls() if defaults is None else defaults
    hints = type_hints(cls)
    docs = field_docs(cls)
    source_types = {f.name: f.type for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        child = section_class(hints[f.name])
        doc = docs.get(f.name, "")
        if child is not None:
            yield KeyInfo(key, child.__name__, None, doc, True)
            yield from iter_keys(child, key + ".", getattr(defaults, f.name))
        else:
            yield KeyInfo(key, str(source_types[f.name]), getattr(defaults, f.name), doc, False)


@functools.cache
def all_keys() -> dict[str, KeyInfo]:
    return {info.key: info for info in iter_keys()}


def leaf_type(key: str) -> Any:
    """The Python type hint of a leaf key (raises KeyError for an unknown key)."""
    cls: type = PostTrainConfig
    *parents, name = key.split(".")
    for part in parents:
        cls = type_hints(cls)[part]
    return type_hints(cls)[name]


def format_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)) and not value:
        return "[]" if isinstance(value, list) else "{}"
    return str(value)


def _resolved(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return config


@functools.cache
def builtin_run_values() -> dict[str, Any]:
    """{key: value} where the built-in run (`posttrain train`, builtin.yaml) differs from verl's defaults,
    both resolved (a `${...}` default counts as the value it follows: critic.rollout_n is 4 there)."""
    from posttrain.config import BUILTIN_CONFIG
    from posttrain.config.load import load_config

    verl, builtin = load_config(validate=False), load_config(base=BUILTIN_CONFIG, validate=False)
    leaves = [info.key for info in iter_keys() if not info.is_section]
    return {key: _resolved(builtin, key) for key in leaves if _resolved(builtin, key) != _resolved(verl, key)}


KEYS_HEADER = ("verl default: what `posttrain train --config FILE`, main_ppo and load_config(path) start from; "
               "built-in run: what `posttrain train` with no --config uses (blank: the same as verl's default)")


def keys_table() -> str:
    """Plain-text listing for `posttrain config --keys`: key, verl's default, the built-in run's value,
    then the meaning on the next line."""
    leaves = [info for info in iter_keys() if not info.is_section]
    builtin = builtin_run_values()
    key_width = max(len(info.key) for info in leaves)
    default_width = 32  # longer defaults push the built-in column right on their own row only
    lines = [KEYS_HEADER, "", f"{'key':<{key_width}}  {'verl default':<{default_width}}  built-in run"]
    for info in leaves:
        mine = format_value(builtin[info.key]) if info.key in builtin else ""
        row = f"{info.key:<{key_width}}  {format_value(info.default):<{default_width}}  {mine}".rstrip()
        lines.append(f"{row}\n    {info.doc}")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_reference() -> str:
    """The generated `docs/config.md`: one table per top-level section."""
    out = [
        "# Config key reference",
        "",
        "Generated by `posttrain config --markdown` from the schema's doc strings; do not edit by hand.",
        "Keys and defaults are verl 0.9's; keys marked (posttrain) are ours. A default `${key}` follows that key.",
        "The default is what `posttrain train --config FILE`, `python -m posttrain.trainer.main_ppo` and",
        "`posttrain.load_config(path)` start from; the built-in run column is what `posttrain train` with no",
        "`--config` uses (`posttrain/config/builtin.yaml`), shown where it differs.",
        "",
    ]
    builtin = builtin_run_values()
    current = None
    for info in iter_keys():
        top = info.key.split(".")[0]
        if top != current:
            current = top
            top_info = all_keys()[top]
            out += ["", f"## `{top}`", "", top_info.doc, "", "| key | type | default | built-in run | meaning |",
                    "|---|---|---|---|---|"]
            continue
        if info.is_section:
            continue
        default = format_value(info.default)
        typ = info.type.replace("|", "\\|")
        mine = f"`{_cell(format_value(builtin[info.key]))}`" if info.key in builtin else ""
        out.append(f"| `{info.key}` | {typ} | `{_cell(default)}` | {mine} | {info.doc} |")
    from posttrain.config.sft_load import sft_markdown_reference  # the SFT / DPO trainers' own tree

    return "\n".join(out) + "\n" + sft_markdown_reference()
