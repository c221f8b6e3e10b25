"""What the agent endpoint adds per call over calling the engine directly, and 16 episodes at once.

    python benchmarks/bench_agent_endpoint.py [--model smollm2-135m-instruct] [--calls 40] [--max-tokens 8]

Per call, alternating, the same chat and the same greedy decode of ``--max-tokens`` tokens:

- ``engine``: the prompt rendered and tokenised, ``engine.generate`` on it (the hf engine), the reply decoded;
- ``endpoint``: the same chat through the official ``openai`` client with an episode's key to the run's
  endpoint (`posttrain.agents`: HTTP, the request hook, the chat template, the batcher's thread, tool-call
  parsing, the recorder), a fresh episode per call as a run has.

It prints the median of each and the median of the per-pair difference (the endpoint's added latency),
then ``--episodes`` (16) three-turn appending episodes run at once through the endpoint against the same
episodes one after another (wall time; the batcher's largest batch). One JSON line at the end.
Name the machine and its load (``uptime``) with any figure: on a shared machine the difference, not the
absolute times, is the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)

    import openai
    import torch

    from posttrain.agents.sessions import EpisodeSessions
    from posttrain.batch import Batch
    from posttrain.rollout.base import SamplingParams
    from posttrain.serve.server import CompletionServer, build_engine

    if args.threads:
        torch.set_num_threads(args.threads)
    engine, tok, _ = build_engine("hf", args.model)
    messages = [{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": "What is 12 * 34?"}]
    sampling = SamplingParams(n=1, temperature=0.0, do_sample=False, response_length=args.max_tokens)
    sessions = EpisodeSessions()
    server = CompletionServer(engine, tok, model_name="policy", api_key=sessions.check_key, recorder=sessions.record,
                              hook=sessions, admit=sessions.admit).start()
    sessions.max_model_len = server.batcher.max_model_len

    def direct() -> tuple[str, float]:
        ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False)["input_ids"]
        batch = Batch.from_dict({"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                                 "position_ids": torch.arange(len(ids))[None]})
        start = time.perf_counter()
        out = engine.generate(batch, sampling)
        engine_s = time.perf_counter() - start
        return tok.decode(out["responses"][0][out["response_mask"][0].bool()].tolist(), skip_special_tokens=True), engine_s

    client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0)  # one connection, kept alive

    def through_endpoint() -> tuple[str, float]:
        (episode,) = sessions.open(1, sampling)
        client.api_key = episode.key
        before = server.batcher.stats["engine_s"]
        try:
            text = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
            return text, server.batcher.stats["engine_s"] - before
        finally:
            sessions.close()

    assert direct()[0] == through_endpoint()[0], "the endpoint and the engine decode differently"
    totals: dict[str, list[float]] = {"engine": [], "endpoint": []}
    outside: dict[str, list[float]] = {"engine": [], "endpoint": []}  # the call's time outside engine.generate
    for _ in range(args.calls):
        for name, fn in (("engine", direct), ("endpoint", through_endpoint)):
            start = time.perf_counter()
            _, in_engine = fn()
            totals[name].append(time.perf_counter() - start)
            outside[name].append(totals[name][-1] - in_engine)
    ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    added = [b - a for a, b in zip(totals["engine"], totals["endpoint"])]
    added_outside = [b - a for a, b in zip(outside["engine"], outside["endpoint"])]
    result = {"model": args.model, "calls": args.calls, "max_tokens": args.max_tokens,
              "engine_ms_median": ms(totals["engine"]), "endpoint_ms_median": ms(totals["endpoint"]),
              "added_ms_median": ms(added), "outside_generate_ms_median_engine": ms(outside["engine"]),
              "outside_generate_ms_median_endpoint": ms(outside["endpoint"]), "added_outside_generate_ms_median": ms(added_outside)}
    print(f"per call ({args.calls} pairs, {args.max_tokens} tokens greedy): engine {result['engine_ms_median']:.1f} ms, "
          f"endpoint {result['endpoint_ms_median']:.1f} ms (median of the pairs' difference {result['added_ms_median']:.1f} ms); "
          f"outside engine.generate: {result['outside_generate_ms_median_engine']:.1f} ms direct, "
          f"{result['outside_generate_ms_median_endpoint']:.1f} ms through the endpoint: added "
          f"{result['added_outside_generate_ms_median']:.1f} ms (median)", flush=True)
    result.update(_concurrent(server, sessions, sampling, messages, args.episodes))
    server.stop()
    result["load_average"] = os.getloadavg()
    print(json.dumps(result))
    return result


def _concurrent(server, sessions, sampling, messages, count: int) -> dict:
    """``count`` three-turn episodes at once, then one after another: wall seconds and the largest batch."""
    import openai

    async def episode(key: str) -> None:
        client = openai.AsyncOpenAI(base_url=server.url, api_key=key, max_retries=0)
        history = list(messages)
        for turn in range(3):
            r = await client.chat.completions.create(model="policy", messages=history)
            history += [{"role": "assistant", "content": r.choices[0].message.content},
                        {"role": "user", "content": f"And times {turn + 2}?"}]
        await client.close()

    async def run(keys: list[str], together: bool) -> None:
        if together:
            await asyncio.gather(*(episode(k) for k in keys))
        else:
            for k in keys:
                await episode(k)

    out = {}
    for together in (True, False):
        episodes = sessions.open(count, sampling)
        server.batcher.stats["largest_batch_rows"] = 0
        start = time.perf_counter()
        asyncio.run(run([e.key for e in episodes], together))
        wall = time.perf_counter() - start
        name = "concurrent" if together else "sequential"
        out[f"{name}_s"] = wall
        out[f"{name}_largest_batch"] = server.batcher.stats["largest_batch_rows"]
        out[f"{name}_reused_prompts"] = sum(e.counts["reused_prompts"] for e in episodes)
        sessions.close()
    print(f"{count} episodes x 3 turns: at once {out['concurrent_s']:.1f} s (largest batch "
          f"{out['concurrent_largest_batch']} rows), one after another {out['sequential_s']:.1f} s: "
          f"{out['sequential_s'] / out['concurrent_s']:.2f}x", flush=True)
    return out


if __name__ == "__main__":
    main()
