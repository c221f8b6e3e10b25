"""Walk the config schema: every dotted key with its type, default and one-line doc.

The doc of a field is the string literal right under it in the class body (as in cleanrl's
`Args`), read from the source with `ast`, so each key is documented exactly once. The reference
printed from these (`posttrain config --keys`, ``docs/config.md``) is `posttrain.config.reference`.
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
def all_keys(root: type = PostTrainConfig) -> dict[str, KeyInfo]:
    """Every key of the tree under ``root`` (the RL config; `posttrain.config.sft`'s for SFT, DPO)."""
    return {info.key: info for info in iter_keys(root)}


def leaf_type(key: str, root: type = PostTrainConfig) -> Any:
    """The Python type hint of a leaf key (raises KeyError for an unknown key)."""
    cls: type = root
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
