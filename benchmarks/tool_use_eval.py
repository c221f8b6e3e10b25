"""Tool use on held-out rows: how often the model calls a tool, how many of its calls are valid, and
its accuracy, with greedy multi-turn rollouts (the tools run between turns).

    python benchmarks/tool_use_eval.py --model smollm2-135m-instruct --data ~/data/tool_arithmetic/test.parquet \
        --tool-config examples/tool_config/arithmetic_tools_config.yaml [--json out.json] [key=value ...]

The rollouts are `posttrain eval`'s (`posttrain.trainer.evaluate.evaluate` with
``actor_rollout_ref.rollout.multi_turn.enable=True``: the trainer's hf engine in the multi-turn loop,
the task's scorer); this script only reads its responses again with the rollout's own parser:

- ``tool_call_rate``: the share of rows whose first assistant turn holds a ``<tool_call>`` block;
- ``valid_call_fraction``: of all the blocks in all assistant turns, the share the parser accepts
  (a JSON object naming an offered tool with arguments that fit its schema); null without calls;
- ``tool_error_fraction``: of all calls, the share whose tool answer was an ``Error: ...`` (invalid
  calls and calls the tool refused or failed);
- ``accuracy``: the mean score (the ``#### N`` after the last turn equals the product);
- ``any_call_rate``: rows that called a tool in any turn (``posttrain eval``'s ``tool_call_rate``).

A response is split into assistant turns at the tool turns the rollout inserted (``<tool_response>``
blocks, as the loop renders them for a chat template without a ``tool`` role, e.g. SmolLM2's).

    python benchmarks/tool_use_eval.py --summary out.jsonl [--timings timings.txt]

prints the stages a pipeline appended to ``out.jsonl`` (``--json``) as one table, and each stage's wall time
with the machine's load around it from ``timings.txt`` (lines ``NAME: N s | before: <uptime> | after:
<uptime>``, as examples/tool_sft_then_grpo.sh writes them).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_TOOL_TURN = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.S)


def assistant_turns(response: str) -> tuple[list[str], list[str]]:
    """(the assistant turns' texts, the tool answers) of one decoded multi-turn response."""
    return _TOOL_TURN.split(response)[0::2], _TOOL_TURN.findall(response)


def tool_use(rows: list[dict], schemas: dict) -> dict[str, float]:
    """The metrics of the module docstring over ``posttrain eval``'s rows."""
    from posttrain.rollout.tool_parser import ToolCall, parse_tool_calls

    first_calls = calls = valid = errors = 0
    for row in rows:
        turns, answers = assistant_turns(row["response"])
        first_calls += "<tool_call>" in turns[0]
        parsed = [c for t in turns for c in parse_tool_calls(t, schemas)]
        calls += len(parsed)
        valid += sum(isinstance(c, ToolCall) for c in parsed)
        errors += sum(a.startswith("Error:") for a in answers)
    n = len(rows)
    return {"n": n, "tool_call_rate": first_calls / n, "valid_call_fraction": valid / calls if calls else None,
            "tool_error_fraction": errors / calls if calls else None, "calls_per_row": calls / n,
            "accuracy": sum(r["score"] for r in rows) / n,
            "any_call_rate": sum(r.get("tool_calls", 0) > 0 for r in rows) / n}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def summary_table(results: list[dict]) -> str:
    """The stages of ``--json`` lines as one table: what each figure is, in its column's name."""
    lines = ["| stage | tool-call rate (first turn) | called in any turn | valid calls | tool errors | "
             "accuracy (#### answer) | rows | eval wall |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['stage'] or r['model']} | {_pct(r['tool_call_rate'])} | {_pct(r['any_call_rate'])} | "
                     f"{_pct(r['valid_call_fraction'])} | {_pct(r['tool_error_fraction'])} | {_pct(r['accuracy'])} | "
                     f"{r['n']} | {r['wall_s']:.0f} s |")
    return "\n".join(lines)


_TIMING = re.compile(r"^(?P<name>.+?): (?P<seconds>\d+) s \| before: .*load averages?: (?P<before>[\d.]+).*"
                     r"\| after: .*load averages?: (?P<after>[\d.]+)")


def timings_text(text: str) -> str:
    """``timings.txt`` as ``NAME: N s (load X -> Y)`` lines (the 1-minute load average before and after the stage)."""
    out = []
    for line in text.splitlines():
        found = _TIMING.match(line.strip())
        out.append(f"{found['name']}: {found['seconds']} s (load {found['before']} -> {found['after']})"
                   if found else line.strip())
    return "\n".join(line for line in out if line)


def summarize(path: str, timings: str | None) -> str:
    results = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not results:
        raise SystemExit(f"error: {path} holds no stage's results (one JSON line per stage, written by --json)")
    text = summary_table(results)
    if timings:
        text += "\n\nwall time per stage (1-minute load average before -> after):\n" + timings_text(
            Path(timings).read_text())
    return text


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--summary", metavar="JSONL", help="print the stages in this --json file as one table, and exit")
    p.add_argument("--timings", help="with --summary: a pipeline's timings.txt, printed with the machine's load")
    p.add_argument("--model", help="as `posttrain eval --model` (required unless --summary)")
    p.add_argument("--data", help="the task's test parquet (posttrain prep tool-arithmetic; required unless --summary)")
    p.add_argument("--tool-config", default=str(ROOT / "examples/tool_config/arithmetic_tools_config.yaml"))
    p.add_argument("--n", type=int, default=None, help="only the first N rows")
    p.add_argument("--max-response-length", type=int, default=128)
    p.add_argument("--max-assistant-turns", type=int, default=3)
    p.add_argument("--stage", default="", help="a label printed with the numbers")
    p.add_argument("--json", default=None, help="append the result as one JSON line to this file")
    p.add_argument("--show", type=int, default=0, help="print the first K responses")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as `posttrain eval`'s")
    args = p.parse_args(argv)
    if args.summary:
        print(summarize(args.summary, args.timings))
        return None
    if not args.model or not args.data:
        p.error("--model and --data are required (or --summary FILE to print a pipeline's results)")

    from posttrain.tools.registry import load_tools_config
    from posttrain.trainer.evaluate import evaluate

    schemas = {t.name: t.tool_schema for t in load_tools_config(args.tool_config)}
    mt = "actor_rollout_ref.rollout.multi_turn"
    overrides = [f"{mt}.enable=True", f"{mt}.tool_config_path={args.tool_config}",
                 f"{mt}.max_assistant_turns={args.max_assistant_turns}", "data.max_prompt_length=256",
                 *args.overrides]
    start = time.time()
    res = evaluate(args.model, [args.data], limit=args.n, max_response_length=args.max_response_length,
                   overrides=overrides)
    out = {"stage": args.stage, "model": args.model, **tool_use(res["rows"], schemas),
           "wall_s": round(time.time() - start, 1)}
    for row in res["rows"][:args.show]:
        print(f"--- score {row['score']:g} (ground truth {row['ground_truth']}): {row['response']!r}")
    print(json.dumps(out))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(out) + "\n")
    return out


if __name__ == "__main__":
    main()
