"""The built-in agentic task: 3-digit multiplications ("What is 347 * 582?") that SmolLM2-135M-Instruct
cannot do in its head but can with a tool, the calculator and the code interpreter both offered.

Each row is an RL row in verl's schema and a multi-turn SFT row (the cold start) at once:

- ``prompt``: a system message naming the offered tools and the hermes call format
  (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, what `posttrain.rollout.tool_parser`
  reads), then the question; ``agent_name: tool_agent``; ``extra_info.tools_kwargs`` names every
  offered tool; ``reward_model.ground_truth``; ``data_source`` is the arithmetic task's, so its
  scorer (``#### N`` at the end) judges the final answer.
- ``messages`` (``data.multiturn.messages_key``): the prompt, an assistant turn that calls one tool,
  the tool's turn holding the tool's real output (the caller runs the tool), and the final answer.
- ``tools`` (``data.multiturn.tools_key``): the offered tools' schemas as one JSON string; Arrow
  would merge the schemas' ``parameters`` structs into one (each tool gaining the other's argument
  as null), so the column is text, decoded by the SFT dataset.

The tool's turn is written as the multi-turn rollout renders it (`posttrain.rollout.multi_turn`):
a chat template without a ``tool`` role (SmolLM2's) gets a user turn with a
``<tool_response>...</tool_response>`` block (``tool_role="user"``); one with a ``tool`` role gets a
``tool`` message (``tool_role="tool"``). The cold start then trains on the tokens the rollout shows.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Sequence

from posttrain.data import arithmetic
from posttrain.data.schema import DataError, write_rows

__all__ = ["OPS", "TOOL_EXAMPLES", "TRACE_TOOLS", "TOOL_ROLES", "SFT_KEYS", "system_prompt", "call_arguments",
           "call_text", "tool_message", "make_rows", "write_tool_arithmetic"]

RunTool = Callable[[str, dict], str]
"""``run(tool name, arguments) -> the text the model reads`` (the tool executed once)."""

# The call each offered tool is shown with in the system message (2-digit numbers: never a question).
TOOL_EXAMPLES: dict[str, dict] = {
    "calculator": {"expression": "12 * 34"},
    "code_interpreter": {"code": "print(12 * 34)"},
}
OPS = ("*",)
"""The task's one operator: products are what a small model cannot work out in its head."""
TRACE_TOOLS = ("calculator", "code_interpreter", "mixed")  # mixed: the two in turn, row by row
TOOL_ROLES = ("user", "tool")
SFT_KEYS = ["data.multiturn.enable=true", "data.multiturn.messages_key=messages", "data.multiturn.tools_key=tools"]
"""The SFT keys that read these files."""


def _call(name: str, arguments: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def system_prompt(tools: Sequence[str]) -> str:
    """The system message: each offered tool's call shown once, and the answer format."""
    unknown = [t for t in tools if t not in TOOL_EXAMPLES]
    if unknown or not tools:
        raise ValueError(f"tools {list(tools)}: the tool task offers some of {list(TOOL_EXAMPLES)}")
    calls = "\nor\n".join(_call(t, TOOL_EXAMPLES[t]) for t in tools)
    return (f"You have {'a tool' if len(tools) == 1 else 'tools'}. Call one by writing\n{calls}\n"
            f"and read its result. {arithmetic.INSTRUCTION}")


def call_arguments(problem: arithmetic.Problem, tool: str) -> dict:
    a, op, b = problem
    return {"expression": f"{a} {op} {b}"} if tool == "calculator" else {"code": f"print({a} {op} {b})"}


def call_text(problem: arithmetic.Problem, tool: str) -> str:
    """The assistant turn that asks ``tool`` for the problem's answer."""
    return _call(tool, call_arguments(problem, tool))


def tool_message(text: str, tool_role: str = "user") -> dict:
    """The tool's turn as the rollout renders it (module docstring)."""
    if tool_role == "tool":
        return {"role": "tool", "content": text}
    return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}


def _trace_tool(trace_tool: str, tools: Sequence[str], index: int) -> str:
    if trace_tool == "mixed":
        return tools[index % len(tools)]
    if trace_tool not in tools:
        raise ValueError(f"trace tool {trace_tool!r} is not offered (offered: {list(tools)})")
    return trace_tool


def make_rows(problems: Sequence[arithmetic.Problem], split: str, tools: Sequence[str], schemas: Sequence[dict],
              run_tool: RunTool, trace_tool: str = "mixed", tool_role: str = "user") -> list[dict]:
    """Rows (module docstring); ``tools`` are the offered tools' names, ``schemas`` their OpenAI
    schemas, ``run_tool`` executes one call. A tool whose output is not the exact answer is a
    DataError: the cold start must never teach a wrong trace."""
    if trace_tool not in TRACE_TOOLS:
        raise ValueError(f"trace tool {trace_tool!r}; expected one of {TRACE_TOOLS}")
    if tool_role not in TOOL_ROLES:
        raise ValueError(f"tool role {tool_role!r}; expected one of {TOOL_ROLES}")
    system = {"role": "system", "content": system_prompt(tools)}
    schemas_text = json.dumps(list(schemas))
    rows = []
    for i, problem in enumerate(problems):
        tool = _trace_tool(trace_tool, tools, i)
        output = run_tool(tool, call_arguments(problem, tool))
        if output.strip() != str(problem.answer):
            raise DataError(f"{tool} answered {output!r} to {call_text(problem, tool)}; expected {problem.answer}")
        prompt = [system, {"role": "user", "content": problem.question}]
        a, op, b = problem
        answer = output.strip()
        rows.append({
            "data_source": arithmetic.DATA_SOURCE,
            "agent_name": "tool_agent",
            "prompt": prompt,
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
            "extra_info": {"split": split, "index": i, "question": problem.question,
                           "tools_kwargs": {t: {"create_kwargs": {"ground_truth": str(problem.answer)}} for t in tools}},
            "messages": prompt + [{"role": "assistant", "content": call_text(problem, tool)},
                                  tool_message(output, tool_role),
                                  {"role": "assistant", "content": f"{a} {op} {b} = {answer}\n#### {answer}"}],
            "tools": schemas_text,
        })
    return rows


def write_tool_arithmetic(out_dir: str, tools: Sequence[str], schemas: Sequence[dict], run_tool: RunTool,
                          n_train: int = 512, n_test: int = 64, digits: int = 3, seed: int = 0,
                          trace_tool: str = "mixed", tool_role: str = "user") -> tuple[str, str]:
    """``train.parquet`` and ``test.parquet`` of multiplications in ``out_dir``; their paths."""
    train, test = arithmetic.generate_problems(n_train, n_test, digits, OPS, seed)
    paths = (os.path.join(out_dir, "train.parquet"), os.path.join(out_dir, "test.parquet"))
    for problems, split, path in ((train, "train", paths[0]), (test, "test", paths[1])):
        write_rows(make_rows(problems, split, tools, schemas, run_tool, trace_tool, tool_role), path)
    return paths
