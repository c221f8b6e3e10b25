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


def test_retry_rows_and_the_arithmetic_interaction():
    import asyncio
    from pathlib import Path

    from posttrain.data.arithmetic import make_rows
    from posttrain.interactions.registry import load_interaction_config
    from posttrain.rollout.multi_turn_checks import check_rows

    _, test = generate_problems(8, 2, digits=2, ops=("+",), seed=0)
    rows = make_rows(test, "test", "retry")
    kwargs = rows[0]["extra_info"]["interaction_kwargs"]
    assert kwargs == {"name": "arithmetic", "ground_truth": str(test[0].answer)}
    assert rows[0]["prompt"] == make_messages(test[0], "fewshot_instruct")
    example = Path(__file__).parents[2] / "examples" / "interaction_config" / "arithmetic_interaction_config.yaml"
    inters = load_interaction_config(str(example))
    check_rows(rows, "test.parquet", None, list(inters))
    inter = inters["arithmetic"]

    async def two_tries():
        iid = await inter.start_interaction(None, **{k: v for k, v in kwargs.items() if k != "name"})
        wrong = await inter.generate_response(iid, [{"role": "assistant", "content": f"#### {test[0].answer + 1}"}])
        right = await inter.generate_response(iid, [{"role": "assistant", "content": f"#### {test[0].answer}"}])
        return wrong, right, await inter.calculate_score(iid)

    wrong, right, score = asyncio.run(two_tries())
    assert wrong[0] is False and wrong[2] == 0.0 and "again" in wrong[1]
    assert right[0] is True and right[2] == 1.0 and score == 1.0
    assert "interaction_kwargs" not in make_rows(test, "test", "fewshot")[0]["extra_info"]  # other styles unchanged
