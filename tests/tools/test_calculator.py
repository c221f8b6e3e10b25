"""The calculator tool: arithmetic by an ast walk, never eval; refusals are messages, not crashes."""

import asyncio

import pytest

from posttrain.tools.calculator_tool import CalculatorError, CalculatorTool, evaluate, format_number


@pytest.mark.parametrize("expr, value", [
    ("123 * 45", 5535), ("-(2 + 3) ** 2", -25), ("7 / 2", 3.5), ("7 // 2", 3), ("7 % 3", 1), ("+4 - -4", 8),
    ("2 ** 10", 1024), ("2 ** -1", 0.5), ("(1 + 2) * (3 + 4)", 21), ("1.5 * 4", 6.0),
])
def test_valid_expressions(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr, why", [
    ("__import__('os').system('true')", "Call is not allowed"),
    ("().__class__", "Attribute is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("'a' * 3", "Constant is not allowed"),
    ("[1][0]", "Subscript is not allowed"),
    ("lambda: 1", "Lambda is not allowed"),
    ("1 if 1 else 2", "IfExp is not allowed"),
    ("2 ** 1000", "exponent 1000 is too large"),
    ("9 ** 64 ** 2", "too large"),
    ("(2 ** 60) ** 60", "too large"),
    ("1 / 0", "division by zero"),
    ("1 // 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("1 +", "cannot parse"),
    ("1" * 201, "at most 200"),
    ("True + 1", "Constant is not allowed"),
])
def test_refusals(expr, why):
    with pytest.raises(CalculatorError, match=why.replace("(", r"\(").replace("*", r"\*")):
        evaluate(expr)


def test_formatting():
    assert [format_number(v) for v in (6.0, 3.5, 1 / 3, 10 ** 20)] == ["6", "3.5", "0.333333333333", str(10 ** 20)]


def test_tool_answers_and_errors():
    tool = CalculatorTool()
    assert tool.name == "calculator"
    resp, reward, metrics = asyncio.run(tool.execute("i", {"expression": "12*12"}))
    assert (resp.text, reward, metrics) == ("144", 0.0, {})
    resp, _, metrics = asyncio.run(tool.execute("i", {"expression": "__import__('os')"}))
    assert resp.text.startswith("Error: Call is not allowed") and metrics == {"tool_error": 1.0}
