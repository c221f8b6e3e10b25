"""A calculator tool: evaluates an arithmetic expression with a small parser, never ``eval``.

The expression is parsed by Python's ``ast`` in ``eval`` mode and the tree is walked by hand:
only numbers, ``+ - * / // % **``, unary plus/minus and parentheses are evaluated; a name, call,
attribute, subscript, string or anything else is refused with a message the model can read.
Limits keep one call cheap: at most :data:`MAX_EXPRESSION_CHARS` characters, exponents at most
:data:`MAX_EXPONENT` in size, and results at most :data:`MAX_RESULT_BITS` bits.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from posttrain.tools.base_tool import BaseTool
from posttrain.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["CalculatorTool", "CalculatorError", "evaluate", "CALCULATOR_SCHEMA"]

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_RESULT_BITS = 512

CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "The expression, e.g. 123 * 45"}},
            "required": ["expression"],
        },
    },
}

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is shown to the model."""


def evaluate(expression: str) -> int | float:
    """The value of ``expression`` (module docstring for what is allowed); CalculatorError otherwise."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r} as arithmetic") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        return _checked(_BINARY[type(node.op)](left, right))
    raise CalculatorError(f"{type(node).__name__} is not allowed: only numbers, + - * / // % ** and parentheses")


def _check_power(base: int | float, exponent: int | float) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} is too large (at most {MAX_EXPONENT} in size)")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero (0 to a negative power)")
    if base < 0 and not float(exponent).is_integer():
        raise CalculatorError("a negative number to a fractional power is not a real number")
    if abs(base) > 1 and exponent > 0 and math.log2(abs(base)) * exponent > MAX_RESULT_BITS:
        raise CalculatorError(f"the result of {base} ** {exponent} is too large")


def _checked(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_RESULT_BITS:
        raise CalculatorError("the result is too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    return value


def format_number(value: int | float) -> str:
    """Integers exactly; floats to 12 significant digits, without a trailing ``.0``."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".12g")
    return str(value)


class CalculatorTool(BaseTool):
    """``calculator(expression: str)``: the value as text, or the reason it cannot be computed.

    The schema defaults to :data:`CALCULATOR_SCHEMA` when the tool config gives none. No state, no
    reward (step reward 0); a refused expression counts as a tool error in the metrics.
    """

    def __init__(self, config: dict | None = None, tool_schema: OpenAIFunctionToolSchema | dict | None = None):
        super().__init__(config, tool_schema if tool_schema is not None else CALCULATOR_SCHEMA)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        try:
            return ToolResponse(format_number(evaluate(parameters.get("expression", "")))), 0.0, {}
        except CalculatorError as err:
            return ToolResponse(f"Error: {err}"), 0.0, {"tool_error": 1.0}
