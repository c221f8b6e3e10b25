"""How often a judge's reward agrees with the rule on held-out samples of the built-in task.

    python examples/judge_agreement.py --judge checkpoints/examples/judge_reward/sft/hf_model \
        --judge smollm2-135m-instruct --styles solve,verdict

The policy (``--policy``, the built-in run's SmolLM2-135M-Instruct) answers the built-in task's 128 held-out
questions ``--n`` times at temperature 1 (what GRPO trains on); each answer is scored by the rule
(`posttrain.rewards.arithmetic`, strict: the number after ``####``) and by ``examples/judge_reward.py``'s
``compute_score`` in each ``--styles``, asking ``--judge`` (a model, served here with posttrain serve, or
the URL of an OpenAI-compatible endpoint). Prints per style: agreement, the judge's precision and recall
against the rule, the share it scores 1, and its time.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def held_out_rows() -> list[dict]:
    import pandas as pd

    from posttrain.config import BUILTIN_CONFIG, load_config
    from posttrain.trainer.setup import data_files

    _, val = data_files(load_config(base=BUILTIN_CONFIG))
    return pd.read_parquet(val).to_dict("records")


def _serve(model: str):
    from posttrain.serve.server import CompletionServer, build_engine

    engine, tokenizer, _ = build_engine("hf", model, dtype="fp32")
    return CompletionServer(engine, tokenizer, model_name="m", default_max_tokens=24).start()


async def _sample(url: str, rows: list[dict], n: int, seed: int) -> list[list[str]]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        async def one(i, row):
            body = {"model": "m", "messages": [dict(m) for m in row["prompt"]], "n": n, "temperature": 1.0,
                    "max_tokens": 24}
            reply = (await client.post("/chat/completions", json=body)).json()
            return [c["message"]["content"] for c in reply["choices"]]

        return list(await asyncio.gather(*(one(i, row) for i, row in enumerate(rows))))


async def _judge(fn, address: str, rows: list[dict], answers: list[list[str]]) -> list[list[float]]:
    async def one(row, text):
        out = await fn(data_source=row["data_source"], solution_str=text, ground_truth=row["reward_model"]["ground_truth"],
                       extra_info=dict(row["extra_info"]), reward_router_address=address, reward_model_tokenizer=None)
        return float(out["score"] if isinstance(out, dict) else out)

    scores = await asyncio.gather(*(one(row, text) for row, texts in zip(rows, answers) for text in texts))
    n = len(answers[0])
    return [list(scores[i * n:(i + 1) * n]) for i in range(len(rows))]


def agreement(rule: list[float], judge: list[float]) -> dict[str, float]:
    pairs = list(zip(rule, judge))
    both = sum(1 for r, j in pairs if r and j)
    return {"agreement": sum(1 for r, j in pairs if bool(r) == bool(j)) / len(pairs),
            "precision": both / max(1, sum(1 for _, j in pairs if j)),
            "recall": both / max(1, sum(1 for r, _ in pairs if r)),
            "judge_positive": sum(1 for _, j in pairs if j) / len(pairs),
            "rule_positive": sum(1 for r, _ in pairs if r) / len(pairs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--judge", required=True, action="append",
                   help="a judge: a model folder / name, or an http(s):// endpoint (repeat to compare judges on the same answers)")
    p.add_argument("--policy", default="smollm2-135m-instruct", help="the model whose answers are judged")
    p.add_argument("--styles", default="solve,verdict", help="judge_reward.py styles to measure, comma-separated")
    p.add_argument("--n", type=int, default=4, help="answers per held-out question (GRPO's rollout.n)")
    p.add_argument("--questions", type=int, default=128, help="held-out questions (at most 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    import os

    import torch

    # on a machine whose cores other jobs keep busy, one thread (OpenMP's barriers wait on descheduled peers)
    busy = os.getloadavg()[0] > (os.cpu_count() or 1) - 0.5
    torch.set_num_threads(1 if busy else (os.cpu_count() or 1))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: {torch.get_num_threads()} torch thread(s)")

    from posttrain.rewards import judge as judge_client
    from posttrain.rewards.arithmetic import compute_score as rule

    rows = held_out_rows()[: args.questions]
    start = time.perf_counter()
    policy = _serve(args.policy)
    answers = asyncio.run(_sample(policy.url, rows, args.n, args.seed))
    policy.stop()
    sampled = time.perf_counter() - start
    rule_scores = [rule(text, row["reward_model"]["ground_truth"]) for row, texts in zip(rows, answers) for text in texts]
    print(f"policy {args.policy}: {len(rule_scores)} answers in {sampled:.0f} s; rule accuracy "
          f"{100 * sum(rule_scores) / len(rule_scores):.1f}%", flush=True)

    spec = importlib.util.spec_from_file_location("judge_reward", HERE / "judge_reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results: dict[str, dict] = {}
    for judge in args.judge:
        server = None if judge.startswith(("http://", "https://")) else _serve(judge)
        address = judge if server is None else server.address
        judge_client.set_default_limits(timeout_s=600, on_error="zero", max_concurrent=64, model="m" if server else None)
        for style in args.styles.split(","):
            module.STYLE = style
            start = time.perf_counter()
            judged = asyncio.run(_judge(module.compute_score, address, rows, answers))
            seconds = time.perf_counter() - start
            figures = agreement(rule_scores, [s for group in judged for s in group])
            results.setdefault(judge, {})[style] = {**figures, "seconds": seconds}
            print(f"judge {judge} ({style}): agreement with the rule {100 * figures['agreement']:.1f}%, precision "
                  f"{100 * figures['precision']:.1f}%, recall {100 * figures['recall']:.1f}%, scores 1 on "
                  f"{100 * figures['judge_positive']:.1f}% (the rule on {100 * figures['rule_positive']:.1f}%), "
                  f"{seconds:.0f} s", flush=True)
        if server is not None:
            server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps({"policy": args.policy, "n": args.n, "answers": len(rule_scores),
                                               "rule_accuracy": sum(rule_scores) / len(rule_scores),
                                               "judges": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
