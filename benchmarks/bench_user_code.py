"""What running each tool/interaction call in a daemon thread of its own costs (issue 40).

`posttrain.tools.user_code.run_user_code` starts a thread (and, for a coroutine, an event loop) per call
so that a call which blocks cannot stall the agent loop. This measures the added time per call against
awaiting the same coroutine on the loop directly, for a trivial ``async`` tool (the worst case: the
overhead is all there is) and for the calculator tool, ``--calls`` calls one after another and
``--parallel`` at once.

    python benchmarks/bench_user_code.py                 # 2000 calls, 1 and 16 at once
    python benchmarks/bench_user_code.py --calls 500 --json out.json

Timings on a shared machine are contended: report the load average beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.tools.calculator_tool import CalculatorTool  # noqa: E402
from posttrain.tools.user_code import run_user_code  # noqa: E402


async def _trivial() -> tuple[str, float, dict]:
    return "ok", 0.0, {}


def _factories() -> dict:
    calc = CalculatorTool()
    return {"trivial async tool": lambda: _trivial(),
            "calculator 123*45": functools.partial(calc.execute, "i", {"expression": "123*45"})}


async def _timed(make, calls: int, parallel: int, threaded: bool) -> float:
    """Seconds per call, ``calls`` calls in waves of ``parallel``."""
    async def one():
        if threaded:
            return await run_user_code(make, timeout=30.0, what="bench")
        return await make()

    start = time.perf_counter()
    for _ in range(calls // parallel):
        await asyncio.gather(*(one() for _ in range(parallel)))
    return (time.perf_counter() - start) / (calls // parallel * parallel)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--parallel", default="1,16", help="comma-separated calls at once")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    rows = []
    for name, make in _factories().items():
        for parallel in (int(p) for p in args.parallel.split(",")):
            direct = asyncio.run(_timed(make, args.calls, parallel, threaded=False))
            threaded = asyncio.run(_timed(make, args.calls, parallel, threaded=True))
            rows.append({"call": name, "parallel": parallel, "direct_us": direct * 1e6, "threaded_us": threaded * 1e6,
                         "added_us": (threaded - direct) * 1e6})
            print(f"{name:20s} {parallel:3d} at once: direct {direct * 1e6:8.1f} us/call, own thread "
                  f"{threaded * 1e6:8.1f} us/call (+{(threaded - direct) * 1e6:.1f} us)", flush=True)
    out = {"cpu": platform.processor() or platform.machine(), "load_average": os.getloadavg(),
           "calls": args.calls, "rows": rows}
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
