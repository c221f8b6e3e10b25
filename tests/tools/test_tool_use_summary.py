"""The tool example's ending (issue 59): `benchmarks/tool_use_eval.py --summary` prints the stages' JSON lines as
one table whose columns name their metrics, and each stage's wall time with the load around it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool_use_eval():
    spec = importlib.util.spec_from_file_location("tool_use_eval", ROOT / "benchmarks" / "tool_use_eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STAGES = [
    {"stage": "base", "model": "m", "n": 64, "tool_call_rate": 0.0, "valid_call_fraction": None,
     "tool_error_fraction": None, "calls_per_row": 0.0, "accuracy": 0.0, "any_call_rate": 0.0, "wall_s": 41.2},
    {"stage": "RL", "model": "g", "n": 64, "tool_call_rate": 1.0, "valid_call_fraction": 1.0,
     "tool_error_fraction": 0.03125, "calls_per_row": 1.0, "accuracy": 0.9375, "any_call_rate": 1.0, "wall_s": 39.6},
]
TIMINGS = ("prep: 3 s | before:  08:20:47 up  3:30,  0 user,  load average: 2.88, 1.51, 1.55 | after:  08:20:50 up "
           "3:30,  0 user,  load average: 2.91, 1.52, 1.55\n"
           "RL (posttrain train, GRPO with tools): 657 s | before:  08:21:00 up 3:30,  0 user,  load average: 1.40, "
           "1.5, 1.5 | after:  08:32:00 up 3:41,  0 user,  load average: 5.02, 4.1, 3.0\n")


def test_the_summary_is_one_table_and_the_stage_times(tmp_path, tool_use_eval, capsys):
    results, timings = tmp_path / "tool_use.jsonl", tmp_path / "timings.txt"
    results.write_text("".join(json.dumps(r) + "\n" for r in STAGES))
    timings.write_text(TIMINGS)
    assert tool_use_eval.main(["--summary", str(results), "--timings", str(timings)]) is None
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| stage | tool-call rate (first turn) | called in any turn | valid calls | tool errors | "
                             "accuracy (#### answer) |")
    assert out[2] == "| base | 0.0% | 0.0% | - | - | 0.0% | 64 | 41 s |"  # no calls: no valid-call share
    assert out[3] == "| RL | 100.0% | 100.0% | 100.0% | 3.1% | 93.8% | 64 | 40 s |"
    assert out[-2:] == ["prep: 3 s (load 2.88 -> 2.91)", "RL (posttrain train, GRPO with tools): 657 s (load 1.40 -> 5.02)"]
    assert not any(line.startswith("{") for line in out)  # no raw JSON lines


def test_an_empty_results_file_is_one_error_line(tmp_path, tool_use_eval):
    empty = tmp_path / "tool_use.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match=rf"error: {empty} holds no stage's results"):
        tool_use_eval.main(["--summary", str(empty)])
