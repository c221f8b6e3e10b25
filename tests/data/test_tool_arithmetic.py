"""`posttrain prep tool-arithmetic`: the built-in agentic task and its cold-start traces. Each trace's
call parses with the rollout's parser, its tool turn holds what the tool answers for those arguments,
rendered as the multi-turn rollout renders it, and its final answer is what the task's scorer wants."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from posttrain.commands.prep import main
from posttrain.data import arithmetic, tool_arithmetic
from posttrain.data.schema import DataError, read_rows
from posttrain.rewards.arithmetic import compute_score
from posttrain.rollout.tool_parser import ToolCall, parse_tool_calls
from posttrain.tools.calculator_tool import CalculatorTool

ROOT = Path(__file__).resolve().parents[2]


def prep(tmp_path: Path, *extra: str) -> tuple[list[dict], list[dict]]:
    out = tmp_path / "task"
    assert main(["tool-arithmetic", "--output", str(out), "--n-train", "8", "--n-test", "4", *extra]) == 0
    return read_rows(str(out / "train.parquet")), read_rows(str(out / "test.parquet"))


def calculator_answer(arguments: dict) -> str:
    async def once():
        tool = CalculatorTool()
        instance, _ = await tool.create(None)
        return (await tool.execute(instance, arguments))[0].text

    return asyncio.run(once())


def test_rows_hold_parsable_calls_real_tool_outputs_and_scored_answers(tmp_path):
    train, test = prep(tmp_path, "--tools", "calculator")
    schemas = {"calculator": CalculatorTool().tool_schema}
    questions = set()
    for row in train + test:
        product = int(row["reward_model"]["ground_truth"])
        assert row["agent_name"] == "tool_agent" and row["data_source"] == arithmetic.DATA_SOURCE
        assert set(row["extra_info"]["tools_kwargs"]) == {"calculator"}
        system, question, call, tool_turn, answer = row["messages"]
        assert [system, question] == row["prompt"] and system["role"] == "system"
        a, b = map(int, question["content"][len("What is "):-1].split(" * "))
        assert a * b == product and len(str(a)) == len(str(b)) == 3
        (parsed,) = parse_tool_calls(call["content"], schemas)
        assert isinstance(parsed, ToolCall) and parsed.arguments == {"expression": f"{a} * {b}"}
        # the tool turn: the calculator's own answer to those arguments, as the rollout renders it for SmolLM2
        assert tool_turn == {"role": "user",
                             "content": f"<tool_response>\n{calculator_answer(parsed.arguments)}\n</tool_response>"}
        assert compute_score(answer["content"], product) == 1.0
        assert compute_score(answer["content"].replace(str(product), str(product + 1)), product) == 0.0  # negative
        assert json.loads(row["tools"]) == [CalculatorTool().tool_schema.model_dump()]
        questions.add(question["content"])
    assert len(questions) == 12  # test questions never in train


def test_tools_column_keeps_each_schema_when_two_tools_are_offered(tmp_path):
    config = tmp_path / "tools.yaml"
    config.write_text((ROOT / "examples/tool_config/calculator_tool_config.yaml").read_text())
    schema = {"type": "function", "function": {"name": "code_interpreter", "description": "Run Python code.",
              "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
    rows = tool_arithmetic.make_rows(arithmetic.generate_problems(4, 0, 3, ("*",))[0], "train",
                                     ["calculator", "code_interpreter"], [CalculatorTool().tool_schema.model_dump(),
                                                                         schema],
                                     lambda name, args: str(eval(args.get("expression") or args["code"][6:-1])))
    out = tmp_path / "rows.parquet"
    from posttrain.data.schema import write_rows

    write_rows(rows, str(out))
    back = read_rows(str(out))
    assert json.loads(back[0]["tools"])[1] == schema  # no 'expression': None merged in (as an Arrow struct would)
    assert [json.loads(r["messages"][2]["content"][11:-12])["name"] for r in back] == \
        ["calculator", "code_interpreter"] * 2  # mixed: the offered tools in turn
    assert "print(12 * 34)" in back[0]["prompt"][0]["content"] and "12 * 34" in back[0]["prompt"][0]["content"]


def test_a_tool_answer_that_is_not_the_product_is_refused():
    problems = arithmetic.generate_problems(2, 0, 3, ("*",))[0]
    with pytest.raises(DataError, match="expected"):
        tool_arithmetic.make_rows(problems, "train", ["calculator"], [], lambda name, args: "12")


def test_code_interpreter_traces_run_in_the_local_sandbox(tmp_path):
    pytest.importorskip("posttrain.tools.sandbox_fusion_tools")
    train, _ = prep(tmp_path, "--tool-config", str(ROOT / "examples/tool_config/arithmetic_tools_config.yaml"))
    calls = [json.loads(r["messages"][2]["content"][len("<tool_call>"):-len("</tool_call>")]) for r in train]
    assert [c["name"] for c in calls[:2]] == ["calculator", "code_interpreter"]
    code_row = train[1]
    product = code_row["reward_model"]["ground_truth"]
    assert calls[1]["arguments"]["code"].startswith("print(")
    assert code_row["messages"][3]["content"].split("\n")[1] == product
    assert set(code_row["extra_info"]["tools_kwargs"]) == {"calculator", "code_interpreter"}


def test_sft_tokens_are_the_tokens_the_multi_turn_rollout_shows(tmp_path):
    """The cold start trains on the token sequence a rollout produces when the model makes the call:
    the prompt as the RL dataset encodes it, the call and its end-of-turn token, the tool turn the
    rollout inserts (untrained), the answer and its end-of-turn token."""
    from helpers.tokenizer import build_tiny_tokenizer
    from posttrain.config.sft import SFTDataConfig, SFTMultiTurnConfig
    from posttrain.data.rl_dataset import encode_prompts
    from posttrain.data.sft import SFTDataset
    from posttrain.rollout.multi_turn import ToolTurnRenderer

    tok = build_tiny_tokenizer()
    prep(tmp_path, "--tools", "calculator")
    path = tmp_path / "task" / "test.parquet"
    ds = SFTDataset(str(path), tok, replace(SFTDataConfig(), max_length=1024, multiturn=SFTMultiTurnConfig(enable=True)))
    eos = tok.eos_token_id
    renderer = ToolTurnRenderer(tok)
    for row, example in zip(read_rows(str(path)), ds.examples):
        assert example.prompt == list(encode_prompts(tok, [row["prompt"]])[0])
        call, tool_turn, answer = (m["content"] for m in row["messages"][2:])
        output = tool_turn.split("\n")[1]
        pieces = [(tok.encode(call, add_special_tokens=False) + [eos], 1), (renderer.tool_turn([output], eos), 0),
                  (tok.encode(answer, add_special_tokens=False) + [eos], 1)]
        assert example.response == [t for ids, _ in pieces for t in ids]
        assert example.mask == [m for ids, m in pieces for _ in ids]
