"""Python functions as tools (the ``trainer.tools = [fn, ...]`` API, as in TRL): the schema comes from
the function's type hints and its Google-style docstring.

    def multiply(a: int, b: int) -> int:
        \"\"\"Multiply two integers.

        Args:
            a: the first factor.
            b: the second factor.
        \"\"\"
        return a * b

becomes ``{"type": "function", "function": {"name": "multiply", "description": "Multiply two
integers.", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description":
"the first factor."}, ...}, "required": ["a", "b"]}}}``. Parameters with defaults are optional.
A function may be ``async``; a plain one runs in a worker thread so it cannot block the loop.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import typing
from typing import Any, Callable

from posttrain.errors import ConfigError
from posttrain.tools.base_tool import BaseTool
from posttrain.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["FunctionTool", "function_schema"]

_PY_TO_JSON = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def function_schema(fn: Callable) -> dict:
    """The OpenAI function schema of ``fn`` (module docstring); ConfigError naming the function and
    parameter when a parameter has no type hint, a type with no JSON equivalent, or no description."""
    name = getattr(fn, "__name__", None)
    if not name or name == "<lambda>":
        raise ConfigError(f"trainer.tools: {fn!r} needs a name (a def, not a lambda)")
    doc = inspect.getdoc(fn)
    if not doc:
        raise ConfigError(f"trainer.tools: function {name} has no docstring (its first line describes the tool)")
    summary, arg_docs = _parse_docstring(doc)
    hints = typing.get_type_hints(fn)
    props, required = {}, []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigError(f"trainer.tools: function {name} takes *{pname}; tools take named arguments only")
        if pname not in hints:
            raise ConfigError(f"trainer.tools: parameter {pname!r} of {name} has no type hint")
        spec = _json_type(hints[pname], f"parameter {pname!r} of {name}")
        if pname not in arg_docs:
            raise ConfigError(f"trainer.tools: parameter {pname!r} of {name} is not described in the docstring's "
                              "Args: section")
        props[pname] = {**spec, "description": arg_docs[pname]}
        if param.default is param.empty:
            required.append(pname)
    return {"type": "function", "function": {"name": name, "description": summary,
                                             "parameters": {"type": "object", "properties": props, "required": required}}}


def _json_type(hint: Any, what: str) -> dict:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        non_null = [a for a in args if a is not type(None)]
        if len(non_null) == 1:
            return _json_type(non_null[0], what)
    if origin is typing.Literal:
        return {"type": _PY_TO_JSON.get(type(args[0]), "string"), "enum": list(args)}
    base = origin if origin is not None else hint
    if base in _PY_TO_JSON:
        spec = {"type": _PY_TO_JSON[base]}
        if base is list and args:
            spec["items"] = _json_type(args[0], what)
        return spec
    raise ConfigError(f"trainer.tools: {what} has type {hint!r}, which has no JSON Schema type "
                      f"(use {', '.join(t.__name__ for t in _PY_TO_JSON)}, Optional or Literal)")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(summary paragraph, {argument: description}) of a Google-style docstring."""
    summary = doc.split("\n\n", 1)[0].strip().replace("\n", " ")
    args: dict[str, str] = {}
    block = re.search(r"^(?:Args|Arguments|Parameters):\s*\n(.*?)(?:\n\s*\n|\n\S|\Z)", doc, re.S | re.M)
    if block:
        current = None
        for line in block.group(1).splitlines():
            m = re.match(r"^\s+(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
            if m and (current is None or len(line) - len(line.lstrip()) <= _indent(block.group(1))):
                current = m.group(1)
                args[current] = m.group(2).strip()
            elif current is not None and line.strip():
                args[current] += " " + line.strip()
    return summary, args


def _indent(text: str) -> int:
    first = next((line for line in text.splitlines() if line.strip()), "")
    return len(first) - len(first.lstrip())


class FunctionTool(BaseTool):
    """A tool that calls ``fn(**arguments)``; its return value (``str()`` of it) is the response."""

    def __init__(self, fn: Callable):
        super().__init__({}, OpenAIFunctionToolSchema.from_dict(function_schema(fn), f"trainer.tools {fn.__name__}"))
        self.fn = fn

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(**parameters)
        else:
            result = await asyncio.to_thread(self.fn, **parameters)
        return ToolResponse(str(result)), 0.0, {}
