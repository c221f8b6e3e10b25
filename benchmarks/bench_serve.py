"""`posttrain serve` throughput: 32 concurrent short chat requests against the same 32 sent one at a time.

    python benchmarks/bench_serve.py                       # SmolLM2-135M-Instruct, 32 requests, 2 rounds
    python benchmarks/bench_serve.py --requests 16 --max-tokens 32 --json out.json

The server runs as `posttrain serve smollm2-135m-instruct` in its own process (the `hf` engine, fp32, CPU);
the clients are the official `openai` package in threads of this process. Every request is greedy
(temperature 0), so the concurrent answers can be compared with the one-at-a-time answers text for
text. Rounds alternate (one at a time, then concurrent, twice by default) so a change in the machine's
load during the run shows in both. Printed: the machine (lscpu's model name, cores, load average
before and after), requests/s and completion tokens/s of each pass, the ratio, how many answers match,
and the server's batch counters. The machine here is shared: say so beside any figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def machine() -> dict:
    name = "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": name, "cores": os.cpu_count(), "load_average": list(os.getloadavg())}


def questions(count: int) -> list[str]:
    return [f"What is {11 + 7 * i} + {23 + 5 * i}? Answer with the number only." for i in range(count)]


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "posttrain.cli", "serve", model, "--port", "0", "--served-model-name", "m", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError("posttrain serve exited before it listened")
        if " at http://" in line:
            return proc, line.split(" at ")[1].split(";")[0]
    raise RuntimeError("posttrain serve did not start within 600 s")


def ask(client, question: str, max_tokens: int) -> tuple[str, int]:
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}],
                                       max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage.completion_tokens


def one_pass(client, qs: list[str], max_tokens: int, concurrent: bool) -> dict:
    start = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(len(qs)) as pool:
            answers = list(pool.map(lambda q: ask(client, q, max_tokens), qs))
    else:
        answers = [ask(client, q, max_tokens) for q in qs]
    wall = time.perf_counter() - start
    tokens = sum(t for _, t in answers)
    return {"concurrent": concurrent, "wall_s": round(wall, 2), "requests_per_s": round(len(qs) / wall, 3),
            "tokens_per_s": round(tokens / wall, 1), "completion_tokens": tokens, "texts": [a for a, _ in answers]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--server-arg", action="append", default=[], help="passed to posttrain serve (repeatable)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    import httpx
    import openai

    before = machine()
    proc, url = start_server(args.model, args.server_arg)
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600,
                               http_client=httpx.Client(limits=httpx.Limits(max_connections=args.requests + 4)))
        qs = questions(args.requests)
        ask(client, qs[0], args.max_tokens)  # warm-up
        passes = []
        for _ in range(args.rounds):
            for concurrent in (False, True):
                passes.append(one_pass(client, qs, args.max_tokens, concurrent))
                p = passes[-1]
                print(f"{'concurrent' if concurrent else 'one at a time':14s} {p['wall_s']:7.2f} s  "
                      f"{p['requests_per_s']:6.3f} req/s  {p['tokens_per_s']:7.1f} tok/s", flush=True)
        stats = httpx.get(url.rsplit("/v1", 1)[0] + "/health").json()
    finally:
        proc.terminate()
        proc.wait(60)
    after = machine()
    alone = [p for p in passes if not p["concurrent"]]
    together = [p for p in passes if p["concurrent"]]
    ratios = [t["requests_per_s"] / a["requests_per_s"] for a, t in zip(alone, together)]
    same = [sum(x == y for x, y in zip(a["texts"], t["texts"])) for a, t in zip(alone, together)]
    steady = all(a["texts"] == alone[0]["texts"] for a in alone)
    report = {"machine_before": before, "machine_after": after, "model": args.model, "requests": args.requests,
              "max_tokens": args.max_tokens, "throughput_ratio": [round(r, 2) for r in ratios],
              "throughput_ratio_median": round(statistics.median(ratios), 2), "same_greedy_text": same,
              "one_at_a_time_runs_agree": steady, "server": stats,
              "passes": [{k: v for k, v in p.items() if k != "texts"} for p in passes],
              "sample_answers": alone[0]["texts"][:3]}
    print(f"machine: {before['cpu']}, {before['cores']} cores (shared with other work), load average "
          f"{before['load_average'][0]:.2f} before, {after['load_average'][0]:.2f} after")
    print(f"throughput concurrent / one at a time: {report['throughput_ratio']} (median "
          f"{report['throughput_ratio_median']}x); greedy texts equal: {same} of {args.requests}; server: "
          f"{stats.get('batches')} batches, largest {stats.get('largest_batch_rows')} rows")
    print(f"sample answer: {report['sample_answers'][0]!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
