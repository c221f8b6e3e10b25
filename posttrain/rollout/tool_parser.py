"""Tool calls in the model's text, ``hermes`` format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

:func:`parse_tool_calls` returns every block of the text, each either a :class:`ToolCall` ready to
run or a :class:`ToolCallError` whose ``message`` is shown to the model in place of a tool answer
(bad JSON, no name, an unknown tool, arguments that do not fit the tool's schema). A text with no
block has no calls: the trajectory's turn was its final answer. An unclosed ``<tool_call>`` at the
end of the text (the model ran out of tokens) is an error too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from posttrain.tools.schemas import OpenAIFunctionToolSchema, argument_problem

__all__ = ["ToolCall", "ToolCallError", "parse_tool_calls", "TOOL_FORMATS"]

TOOL_FORMATS = ("hermes",)
_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolCallError:
    message: str
    name: str | None = None


def parse_tool_calls(text: str, schemas: Mapping[str, OpenAIFunctionToolSchema],
                     fmt: str = "hermes") -> list[ToolCall | ToolCallError]:
    """The calls of ``text`` in order (module docstring); ``schemas`` maps tool names to schemas."""
    if fmt not in TOOL_FORMATS:
        raise ValueError(f"tool-call format {fmt!r}; valid: {TOOL_FORMATS}")
    return [_one_call(m.group(1), bool(m.group(2)), schemas) for m in _BLOCK.finditer(text)]


def _one_call(body: str, closed: bool, schemas: Mapping[str, OpenAIFunctionToolSchema]) -> ToolCall | ToolCallError:
    if not closed:
        return ToolCallError("the <tool_call> block has no closing </tool_call>")
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError as err:
        return ToolCallError(f"the tool call is not valid JSON ({err.msg} at character {err.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCallError('the tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name, args = obj["name"], obj.get("arguments", {})
    if isinstance(args, str):  # some models send the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCallError(f"the arguments of {name} are not a JSON object", name)
    if name not in schemas:
        return ToolCallError(f"unknown tool {name!r}; available: {', '.join(sorted(schemas)) or 'none'}", name)
    problem = argument_problem(schemas[name], args)
    return ToolCallError(problem, name) if problem else ToolCall(name, args)
