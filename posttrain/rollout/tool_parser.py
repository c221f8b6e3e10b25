"""Tool calls in the model's text, ``hermes`` format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

:func:`parse_tool_calls` returns every block of the text, each either a :class:`ToolCall` ready to
run or a :class:`ToolCallError` whose ``message`` is shown to the model in place of a tool answer
(bad JSON, no name, an unknown tool, arguments that do not fit the tool's schema). A text with no
block has no calls: the trajectory's turn was its final answer. An unclosed ``<tool_call>`` at the
end of the text (the model ran out of tokens) is an error too.

Whatever the model writes ends as a call or an error message, never an exception: a block longer than
``MAX_CALL_CHARS`` or nested deeper than ``MAX_NESTING`` (``[[[[...``, which makes Python's JSON
decoder recurse until ``RecursionError``) is refused before decoding, and every decoder failure
(``ValueError``, which covers bad JSON and integers too long to convert, and ``RecursionError``) is caught.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from posttrain.tools.schemas import OpenAIFunctionToolSchema, argument_problem

__all__ = ["ToolCall", "ToolCallError", "parse_tool_calls", "TOOL_FORMATS", "MAX_NESTING", "MAX_CALL_CHARS"]

TOOL_FORMATS = ("hermes",)
MAX_NESTING = 64  # arrays/objects inside one another; tool arguments need a handful
MAX_CALL_CHARS = 100_000  # characters of one <tool_call> block (a long program for a code tool fits)
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
    obj = _decode(body.strip(), "the tool call")
    if isinstance(obj, ToolCallError):
        return obj
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCallError('the tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name, args = obj["name"], obj.get("arguments", {})
    if isinstance(args, str):  # some models send the arguments as a JSON string
        args = _decode(args, f"the arguments string of {name}")
        if isinstance(args, ToolCallError):
            return ToolCallError(args.message, name)
    if name not in schemas:
        return ToolCallError(f"unknown tool {name!r}; available: {', '.join(sorted(schemas)) or 'none'}", name)
    problem = argument_problem(schemas[name], args)
    return ToolCallError(problem, name) if problem else ToolCall(name, args)


def _decode(text: str, what: str) -> Any:
    """The JSON value of ``text``, or a ToolCallError saying why not (never an exception)."""
    if len(text) > MAX_CALL_CHARS:
        return ToolCallError(f"{what} is {len(text)} characters long; at most {MAX_CALL_CHARS} are read")
    if _nested_deeper_than(text, MAX_NESTING):
        return ToolCallError(f"{what} nests arrays/objects more than {MAX_NESTING} deep")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        return ToolCallError(f"{what} is not valid JSON ({err.msg} at character {err.pos})")
    except (ValueError, RecursionError) as err:  # e.g. an integer of more digits than Python converts
        return ToolCallError(f"{what} cannot be decoded ({type(err).__name__}: {str(err)[:200]})")


def _nested_deeper_than(text: str, limit: int) -> bool:
    """Whether ``[``/``{`` outside JSON strings nest more than ``limit`` deep (one linear pass)."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False
