"""One process with 2 threads versus 2 Ray ranks with 1 thread each, on the built-in run's work.

    python benchmarks/bench_ranks.py                  # 3 timed steps each after one warm-up step
    python benchmarks/bench_ranks.py --steps 2 --json out.json

The work is the built-in run (`posttrain/config/builtin.yaml`: SmolLM2-135M-Instruct, GRPO, 8 prompts
x 4 samples, up to 24 new tokens), computed in fp32 with validation and checkpoints off. Both layouts use the same
2 cores: the one-process run gives torch 2 threads; the 2-rank run gives each rank (a Ray actor with an
FSDP2-sharded actor and reference, gloo) 1 thread and half the batch.

Printed per layout: seconds per step and per phase (`timing_s/*`), tokens per second (all tokens of
the step's sequences / step seconds), and for the ranks the dispatch-and-gather overhead of one step:
the step's five data-parallel calls (generate, old log-prob, ref log-prob, update; the batch split,
sent through Ray's object store and the results gathered) timed as no-op round trips that carry the
same batches (`RankWorker.ping`). Needs a quiet machine: state the load average with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from posttrain.host.threads import choose_wait_policy  # noqa: E402  (imports no torch)

choose_wait_policy()  # as the posttrain CLI, before torch loads (Ray ranks inherit it)

QUIET = ["trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[file]",
         "trainer.resume_mode=disable", "trainer.device=cpu", "trainer.start_over=True",
         # fp32 in both layouts (the README's figures): bf16 over gloo is less certain than fp32
         "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
         "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=fp32"]


def run(ranks: int, steps: int, workdir: Path) -> dict:
    import torch

    from posttrain.config import BUILTIN_CONFIG, load_config
    from posttrain.trainer.trainer import RLTrainer

    torch.set_num_threads(2 if ranks == 1 else 1)
    # the built-in micro-batch (16 responses) is a whole mini-batch in one process; per rank it is 8
    micro = [] if ranks == 1 else ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"]
    overrides = QUIET + micro + [f"trainer.n_gpus_per_node={ranks}", f"trainer.total_training_steps={steps + 1}",
                         f"trainer.run_dir={workdir / f'run{ranks}'}", f"trainer.default_local_dir={workdir / 'ckpt'}"]
    config = load_config(overrides=overrides, base=BUILTIN_CONFIG)
    start = time.perf_counter()
    trainer = RLTrainer(config)
    built = time.perf_counter() - start
    overhead = []
    if ranks > 1:
        original = trainer.train_step

        def step_and_measure(prompts):  # the same batches, sent again as no-op round trips
            metrics = original(prompts)
            overhead.append(dispatch_seconds(trainer, prompts, trainer.last_batch))
            return metrics

        trainer.train_step = step_and_measure
    history = trainer.fit()[1:]  # the first step warms up
    return summarize(ranks, built, history, overhead[1:])


def dispatch_seconds(trainer, prompts, batch) -> float:
    """Driver-side seconds of one step's data-parallel calls with the computing left out."""
    from posttrain.distributed.split import gather_from_ranks, split_for_ranks

    group = trainer.workers
    start = time.perf_counter()
    chunks, pad = split_for_ranks(prompts, group.world_size)
    group._ranks.call_each("ping", chunks)
    for _ in range(4):  # old log-prob, ref, update: the full batch each way; results are [N, R] tensors
        chunks, pad = split_for_ranks(batch, group.world_size)
        group._ranks.call_each("ping", chunks)
        gather_from_ranks([batch["responses"][: len(c)].float() for c in chunks], pad)
    return time.perf_counter() - start


def summarize(ranks: int, built: float, history: list[dict], overhead: list[float]) -> dict:
    step = [h["timing_s/step"] for h in history]
    tokens = [h["perf/total_num_tokens"] for h in history if "perf/total_num_tokens" in h]
    phases = {k.split("/", 1)[1]: statistics.mean(h[k] for h in history)
              for k in history[0] if k.startswith("timing_s/") and k != "timing_s/step"}
    out = {"ranks": ranks, "threads_per_rank": 2 if ranks == 1 else 1, "startup_s": built,
           "step_s": statistics.mean(step), "step_s_all": step, "phases_s": phases}
    if tokens:
        out["tokens_per_s"] = statistics.mean(t / s for t, s in zip(tokens, step))
    if overhead:
        out["dispatch_overhead_s"] = statistics.mean(overhead)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--workdir", default="/tmp/posttrain_bench_ranks")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    results = [run(1, args.steps, workdir), run(2, args.steps, workdir)]
    one, two = results
    for r in results:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["phases_s"].items()))
        extra = f", dispatch+gather {r['dispatch_overhead_s']:.3f} s/step" if "dispatch_overhead_s" in r else ""
        print(f"{r['ranks']} rank(s) x {r['threads_per_rank']} thread(s): start-up {r['startup_s']:.1f} s, "
              f"{r['step_s']:.1f} s/step ({phases}), {r.get('tokens_per_s', float('nan')):.0f} tokens/s{extra}")
    print(f"2 ranks / 1 process step time: {two['step_s'] / one['step_s']:.2f}x; load average at end: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
