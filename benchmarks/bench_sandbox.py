"""What a sandboxed call costs (issue 38's targets: a trivial call <= 50 ms median; 32 calls with
num_workers >= 4 run concurrently).

    python benchmarks/bench_sandbox.py                 # local sandbox, the isolation this machine allows
    python benchmarks/bench_sandbox.py --isolation none --calls 50

Prints the CPU model and the load average before and after (the figures mean little on a busy
machine), the median and p90 round trip of ``print(1)`` (spawn, run, collect, clean up) for the local
sandbox and through `posttrain sandbox serve`'s HTTP handler in this process, and the wall time of 32
calls of ``time.sleep(0.2)`` and of a 30 ms CPU loop with num_workers 4 against the same calls one at
a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import ThreadingHTTPServer

from posttrain.sandbox import Limits, LocalSandbox
from posttrain.sandbox.server import make_handler

SLEEP = "import time\ntime.sleep(0.2)\nprint('done')"
BUSY = "import time\nend = time.process_time() + 0.03\nwhile time.process_time() < end:\n    pass\nprint('done')"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def round_trips(call, count: int) -> list[float]:
    call()  # first call: imports, page cache
    times = []
    for _ in range(count):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def describe(label: str, times: list[float]) -> None:
    ordered = sorted(times)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    print(f"{label}: median {statistics.median(times) * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms, "
          f"min {ordered[0] * 1000:.1f} ms ({len(times)} calls)")


def http_call(url: str) -> None:
    body = json.dumps({"code": "print(1)", "language": "python"}).encode()
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        answer = json.loads(response.read())
    assert answer["status"] == "Success", answer


def batch(sandbox: LocalSandbox, code: str, calls: int, workers: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda _: sandbox.run(code), range(calls)))
    assert all(r.stdout == "done\n" for r in results), results[0]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isolation", default="auto")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()} x {os.cpu_count()}; load average before: {load()}")
    limits = Limits(isolation=args.isolation, network=args.isolation == "none")
    sandbox = LocalSandbox(limits, num_workers=args.workers)
    print(f"isolation: {sandbox.isolation}")
    describe("local round trip, print(1)", round_trips(lambda: sandbox.run("print(1)"), args.calls))

    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(sandbox))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/run_code"
    describe("HTTP round trip (posttrain sandbox serve), print(1)", round_trips(lambda: http_call(url), args.calls))
    server.shutdown()

    for label, code in (("sleep 0.2 s", SLEEP), ("30 ms CPU loop", BUSY)):
        serial = batch(sandbox, code, args.batch, 1)
        together = batch(sandbox, code, args.batch, args.workers)
        print(f"{args.batch} calls of {label}: one at a time {serial:.2f} s, num_workers {args.workers} "
              f"{together:.2f} s ({serial / together:.2f}x)")
    print(f"load average after: {load()}")


if __name__ == "__main__":
    main()
