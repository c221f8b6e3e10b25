"""Python functions as tools (the ``trainer.tools = [fn, ...]`` API, as in TRL): the schema comes from
the function's type hints and its Google-style docstring, through ``transformers.utils.get_json_schema``
(the converter TRL uses).

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
A function may be ``async`` or plain; either runs in a daemon thread of its own
(``posttrain.tools.user_code``), so it can neither block the loop nor keep a finished run's process alive.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any, Callable

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from posttrain.errors import ConfigError
from posttrain.tools.base_tool import BaseTool
from posttrain.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from posttrain.tools.user_code import run_user_code

__all__ = ["FunctionTool", "function_schema"]


def function_schema(fn: Callable) -> dict:
    """The OpenAI function schema of ``fn`` (module docstring); ConfigError naming the function and
    parameter when a parameter has no type hint, a type with no JSON equivalent, or no description."""
    name = getattr(fn, "__name__", None)
    if not name or name == "<lambda>":
        raise ConfigError(f"trainer.tools: {fn!r} needs a name (a def, not a lambda)")
    if not inspect.getdoc(fn):
        raise ConfigError(f"trainer.tools: function {name} has no docstring (its first line describes the tool)")
    _check_parameters(fn, name)
    try:
        schema = get_json_schema(fn)
    except DocstringParsingException as err:
        raise ConfigError(f"trainer.tools: {err} (describe each parameter in the docstring's Args: section)") from err
    except TypeHintParsingException as err:
        raise ConfigError(f"trainer.tools: parameter {_unconvertible_parameter(fn)!r} of {name}: {err}") from err
    function = schema["function"]
    function.pop("return", None)  # the model never writes a return value; keep the schema to what it sends
    # The first paragraph describes the tool; the rest of the docstring is for human readers.
    function["description"] = function["description"].split("\n\n", 1)[0].replace("\n", " ")
    function["parameters"].setdefault("required", [])
    return schema


def _check_parameters(fn: Callable, name: str) -> None:
    """Refusals get_json_schema does not make (``*args``) or words less plainly (a missing hint)."""
    hints = typing.get_type_hints(fn)
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigError(f"trainer.tools: function {name} takes *{pname}; tools take named arguments only")
        if pname not in hints:
            raise ConfigError(f"trainer.tools: parameter {pname!r} of {name} has no type hint")


def _unconvertible_parameter(fn: Callable) -> str | None:
    """The first parameter whose type hint alone get_json_schema refuses (its error names the type only)."""

    def probe(value):
        """One parameter at a time.

        Args:
            value: the parameter under test.
        """

    for pname, hint in typing.get_type_hints(fn).items():
        if pname == "return":
            continue
        probe.__annotations__ = {"value": hint}
        try:
            get_json_schema(probe)
        except TypeHintParsingException:
            return pname
    return None


class FunctionTool(BaseTool):
    """A tool that calls ``fn(**arguments)``; its return value (``str()`` of it) is the response."""

    def __init__(self, fn: Callable):
        super().__init__({}, OpenAIFunctionToolSchema.from_dict(function_schema(fn), f"trainer.tools {fn.__name__}"))
        self.fn = fn

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        # not asyncio.to_thread: its pool's threads are joined at exit, so a function that never returns
        # would keep the process alive after fit() returned
        result = await run_user_code(functools.partial(self.fn, **parameters), timeout=None, what=f"tool {self.name}")
        return ToolResponse(str(result)), 0.0, {}
