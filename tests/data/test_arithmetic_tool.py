"""The built-in multi-turn task's prompt: its worked call is one the parser accepts and the
calculator answers, on numbers that are never a question."""

from posttrain.data.arithmetic import generate_problems, make_messages
from posttrain.rollout.tool_parser import ToolCall, parse_tool_calls
from posttrain.tools.calculator_tool import CalculatorTool, evaluate


def test_tool_prompt_holds_a_valid_worked_call():
    train, test = generate_problems(64, 16, digits=2, ops=("*",), seed=0)
    schemas = {"calculator": CalculatorTool().tool_schema}
    for problem in train[:4] + test[:4]:
        messages = make_messages(problem, "tool")
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
        (call,) = parse_tool_calls(messages[2]["content"], schemas)
        assert isinstance(call, ToolCall)
        value = evaluate(call.arguments["expression"])
        assert messages[3]["content"] == f"<tool_response>\n{value}\n</tool_response>"
        assert messages[4]["content"].endswith(f"#### {value}") and messages[-1]["content"] == problem.question
        assert len(call.arguments["expression"].split()[0]) == 3  # (digits+1)-digit operands: never a question
