"""``posttrain prep tool-arithmetic``: the built-in agentic task with its cold-start traces
(`posttrain.data.tool_arithmetic`). The traces hold each tool's real output, so this preparation runs
the tools (the calculator; the code interpreter in posttrain's local sandbox), which the data room,
knowing rows only, cannot do itself.

    posttrain prep tool-arithmetic --output ~/data/tool_arithmetic
    posttrain prep tool-arithmetic --output DIR --tool-config examples/tool_config/arithmetic_tools_config.yaml
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Sequence

from posttrain.cli_args import file_to_read, int_from_to, non_negative_int, positive_int
from posttrain.data import arithmetic, tool_arithmetic
from posttrain.data.schema import DataError

__all__ = ["add_tool_arithmetic_parser", "builtin_tools", "tool_runner"]

CODE_INTERPRETER = "posttrain.tools.sandbox_fusion_tools.SandboxFusionTool"


def builtin_tools(names: Sequence[str]) -> list[Any]:
    """The named built-in tools: ``calculator`` and ``code_interpreter`` (local sandbox, no URL)."""
    from posttrain.tools.calculator_tool import CalculatorTool

    tools = []
    for name in names:
        if name == "calculator":
            tools.append(CalculatorTool())
        elif name == "code_interpreter":
            try:
                from posttrain.tools.sandbox_fusion_tools import SandboxFusionTool
            except ImportError as err:
                raise DataError(f"the code interpreter ({CODE_INTERPRETER}) does not import ({err}); "
                                "pass --tools calculator") from None
            tools.append(SandboxFusionTool({}, None))
        else:
            raise DataError(f"--tools {name}: the built-in tools are {list(tool_arithmetic.TOOL_EXAMPLES)}")
    return tools


def tool_runner(tools: Sequence[Any]):
    """``run(name, arguments) -> text``: one call as the multi-turn rollout makes it (create, execute,
    release; the response's text), a failure raised, never written as a trace."""
    by_name = {t.name: t for t in tools}

    async def once(name: str, arguments: dict) -> str:
        from posttrain.tools.schemas import ToolResponse

        tool = by_name[name]
        created = await tool.create(None)
        instance = created[0] if isinstance(created, tuple) else created
        try:
            response, _, metrics = await tool.execute(instance, arguments)
        finally:
            await tool.release(instance)
        text = ToolResponse.of(response).text
        if (metrics or {}).get("tool_error"):
            raise DataError(f"{name}({arguments}) failed: {text}")
        return text

    return lambda name, arguments: asyncio.run(once(name, arguments))


def _prep_tool_arithmetic(args) -> int:
    refused = arithmetic.too_few_questions(args.n_train, args.n_test, args.digits, tool_arithmetic.OPS)
    if refused:
        raise DataError(refused)
    if args.tool_config:
        from posttrain.tools.registry import load_tools_config

        tools = load_tools_config(args.tool_config)
    else:
        tools = builtin_tools([t.strip() for t in args.tools.split(",") if t.strip()])
    names = [t.name for t in tools]
    schemas = [t.tool_schema.model_dump() for t in tools]
    train, test = tool_arithmetic.write_tool_arithmetic(
        os.path.expanduser(args.output), names, schemas, tool_runner(tools), n_train=args.n_train,
        n_test=args.n_test, digits=args.digits, seed=args.seed, trace_tool=args.trace_tool, tool_role=args.tool_role)
    print(f"wrote {args.n_train} rows to {train} and {args.n_test} rows to {test} (tools: {', '.join(names)}); "
          f"cold start on them with\n  posttrain sft data.train_files={train} data.val_files={test} "
          f"{' '.join(tool_arithmetic.SFT_KEYS)}")
    return 0


def add_tool_arithmetic_parser(sub) -> None:
    """``posttrain prep tool-arithmetic`` (added to `posttrain.data.prep`'s parser)."""
    a = sub.add_parser("tool-arithmetic", help="the built-in agentic task (multiplications with tools) and its "
                       "cold-start traces (RL + multi-turn SFT rows)")
    a.add_argument("--output", required=True, help="output directory")
    a.add_argument("--n-train", type=positive_int, default=512)
    a.add_argument("--n-test", type=positive_int, default=64)
    a.add_argument("--digits", type=int_from_to(1, arithmetic.MAX_DIGITS), default=3, help="operand width")
    a.add_argument("--seed", type=non_negative_int, default=0)
    a.add_argument("--tools", default="calculator,code_interpreter",
                   help="the built-in tools offered (comma-separated); ignored with --tool-config")
    a.add_argument("--tool-config", type=file_to_read("a tool config YAML file"), default=None,
                   help="a tool config YAML whose tools are offered and run")
    a.add_argument("--trace-tool", default="mixed", choices=tool_arithmetic.TRACE_TOOLS,
                   help="the tool the traces call (mixed: each offered tool in turn)")
    a.add_argument("--tool-role", default="user", choices=tool_arithmetic.TOOL_ROLES,
                   help="how the tool's turn is written: 'user' (a <tool_response> block, as the rollout "
                   "renders it for templates without a tool role, e.g. SmolLM2) or 'tool'")
    a.set_defaults(func=_prep_tool_arithmetic, output_kind="folder")
