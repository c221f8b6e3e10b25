"""Asynchronous rollouts against today's colocated run, the same work on the same cores (issue 39).

    python benchmarks/bench_async.py                      # built-in run: 8 steps, 2 cores
    python benchmarks/bench_async.py --task retry         # the multi-turn retry task (examples/addition_retry.yaml)
    python benchmarks/bench_async.py --tiny               # smoke test (2 steps of 2 prompts x 2)
    python benchmarks/bench_async.py --task retry --steps 4 --staleness 0 --seed 2 --seed-per-batch
                                                          # accuracy with the same draws in both modes

Each mode runs in its own process pinned to the same ``--cores`` CPUs: ``colocated`` is `posttrain train`
(generate, then update, on all the cores); ``async`` is the one-step-off run (actor_rollout_ref.
hybrid_engine=False, one rollout worker on one core, the trainer on the other; staleness_threshold and
trigger_parameter_sync_step from the flags). Both train on the same number of samples (steps x
data.train_batch_size x rollout.n) and validate once at the end on the held-out split.

Printed per mode: samples/s (samples trained / seconds from the start of training to the end of the last
step, pipeline fill included, validation excluded), trainer/idle_ratio and rollouter/idle_ratio (means
over steps), the held-out accuracy; then the async/colocated ratio. Timings on a shared machine are
contended: run it on a quiet one and say which CPU (lscpu) and load (uptime) it was.

The held-out accuracy of a 4-step run moves by several points with the random draws alone. ``--seed-per-batch``
(``actor_rollout_ref.rollout.seed_per_batch``) gives both modes the same draws for the same batch, so their
accuracies differ only by what the placement changes; ``--seed`` sets trainer.seed and data.seed; ``--set
KEY=VALUE`` adds an override to the async run only (e.g. async_training.compute_prox_log_prob=True), ``--both
KEY=VALUE`` one to both runs (e.g. actor_rollout_ref.rollout.name=vllm: the rollout engine of both).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RETRY_YAML = ROOT / "examples" / "addition_retry.yaml"


def overrides(args, run_dir: Path) -> list[str]:
    out = [f"trainer.total_training_steps={args.steps}", f"trainer.test_freq={args.steps}",
           "trainer.val_before_train=False", "trainer.save_freq=-1", "trainer.logger=[file]",
           f"trainer.run_dir={run_dir}", f"trainer.default_local_dir={run_dir / 'ckpt'}",
           f"ray_kwargs.ray_init.num_cpus={args.cores}", "trainer.n_gpus_per_node=1", "trainer.device=cpu"]
    if args.seed is not None:
        out += [f"trainer.seed={args.seed}", f"data.seed={args.seed}"]
    if args.seed_per_batch:
        out.append("actor_rollout_ref.rollout.seed_per_batch=True")
    sizes = (("data.train_batch_size", args.prompts), ("actor_rollout_ref.actor.ppo_mini_batch_size", args.prompts),
             ("actor_rollout_ref.rollout.n", args.n), ("data.max_response_length", args.response_length),
             ("data.arithmetic.n_test", args.n_test))
    out += [f"{key}={value}" for key, value in sizes if value is not None]
    out += args.both
    if args.tiny:
        out += ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]
    if args.task == "retry":
        out.append("actor_rollout_ref.rollout.multi_turn.interaction_config_path="
                   f"{ROOT / 'examples/interaction_config/arithmetic_interaction_config.yaml'}")
    return out


def async_overrides(args) -> list[str]:
    return ["actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.rollout.n_gpus_per_node=1",
            f"async_training.staleness_threshold={args.staleness}",
            f"async_training.trigger_parameter_sync_step={args.sync_every}", *args.set]


def child(args) -> None:
    """One mode in this process: train, then print its figures as one JSON line."""
    import torch

    from posttrain.config import BUILTIN_CONFIG, load_config
    from posttrain.trainer.async_trainer import AsyncRLTrainer
    from posttrain.trainer.trainer import RLTrainer

    run_dir = Path(args.run_dir)
    extra = async_overrides(args) if args.mode == "async" else []
    config_file = RETRY_YAML if args.task == "retry" else None
    config = load_config(config_file, overrides(args, run_dir) + extra, base=None if config_file else BUILTIN_CONFIG)
    if args.mode == "colocated":
        torch.set_num_threads(args.cores)
    trainer = (AsyncRLTrainer if args.mode == "async" else RLTrainer)(config)
    ends, step = [], trainer.step

    def timed_step():
        metrics = step()
        ends.append(time.perf_counter())
        return metrics

    trainer.step = timed_step
    start = time.perf_counter()
    history = trainer.fit()
    samples = len(ends) * config.data.train_batch_size * config.actor_rollout_ref.rollout.n
    rows = [r for r in history if r.get("step", 0) > 0]
    mean = lambda key: (sum(r[key] for r in rows if key in r) / max(1, sum(key in r for r in rows))  # noqa: E731
                        if any(key in r for r in rows) else None)
    acc = {k: v for k, v in rows[-1].items() if k.startswith("val-") and "/acc/mean@" in k}
    print("BENCH " + json.dumps({"mode": args.mode, "samples": samples, "seconds": ends[-1] - start,
                                 "samples_per_s": samples / (ends[-1] - start),
                                 "trainer_idle_ratio": mean("trainer/idle_ratio"),
                                 "rollouter_idle_ratio": mean("rollouter/idle_ratio"),
                                 "accuracy": next(iter(acc.values()), None),
                                 **{name: sum(r.get(f"fully_async/count/{key}", 0) for r in rows) for name, key in
                                    (("stale_samples", "stale_samples_processed"),
                                     ("partial_rollout_samples", "partial_rollout_samples"))}}), flush=True)


def run_mode(args, mode: str, work: Path) -> dict:
    argv = [sys.executable, __file__, "--child", "--mode", mode, "--run-dir", str(work / mode), *args.passed]
    cpus = sorted(os.sched_getaffinity(0))[:args.cores]
    env = {**os.environ, "OMP_NUM_THREADS": "1" if mode == "async" else str(args.cores), "RAY_ADDRESS": "local"}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{mode} run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("BENCH "):])


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=("builtin", "retry"), default="builtin")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=None, help="data.train_batch_size (default: the task's)")
    p.add_argument("--n", type=int, default=None, help="actor_rollout_ref.rollout.n (default: the task's)")
    p.add_argument("--response-length", type=int, default=None)
    p.add_argument("--n-test", type=int, default=None, help="held-out problems (data.arithmetic.n_test)")
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--staleness", type=float, default=1.0, help="async_training.staleness_threshold")
    p.add_argument("--sync-every", type=int, default=1, help="async_training.trigger_parameter_sync_step")
    p.add_argument("--seed", type=int, default=None, help="trainer.seed and data.seed (default: the task's)")
    p.add_argument("--seed-per-batch", action="store_true", help="actor_rollout_ref.rollout.seed_per_batch=True")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override of the async run")
    p.add_argument("--both", action="append", default=[], metavar="KEY=VALUE",
                   help="an override of both runs (e.g. actor_rollout_ref.rollout.name=vllm)")
    p.add_argument("--modes", default="colocated,async", choices=("colocated,async", "colocated", "async"))
    p.add_argument("--tiny", action="store_true", help="smoke test: 2 steps of 2 prompts x 2, 8 tokens, 8 held out")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("colocated", "async"), help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.steps, args.prompts, args.n, args.response_length, args.n_test = 2, 2, 2, 8, 8
    args.passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--child",)]
    return args


def main() -> None:
    args = parse()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        results = {mode: run_mode(args, mode, Path(tmp)) for mode in args.modes.split(",")}
    for mode, r in results.items():
        idle = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        acc = "-" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}%"
        print(f"{mode:10s} {r['samples']} samples in {r['seconds']:.1f} s = {r['samples_per_s']:.2f} samples/s; "
              f"trainer idle {idle(r['trainer_idle_ratio'])}, rollout idle {idle(r['rollouter_idle_ratio'])}; "
              f"held-out accuracy {acc}" + (f"; stale samples trained on {r['stale_samples']:.0f}, taking a push "
                                            f"mid-generation {r['partial_rollout_samples']:.0f}" if mode == "async" else ""))
    ratio = None
    if len(results) == 2:
        ratio = results["async"]["samples_per_s"] / results["colocated"]["samples_per_s"]
        print(f"async / colocated samples/s: {ratio:.2f}x ({args.task} task, {args.cores} cores, staleness "
              f"{args.staleness}, sync every {args.sync_every})")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "ratio": ratio, "args": vars(args)}, indent=1,
                                              default=str))


if __name__ == "__main__":
    main()
