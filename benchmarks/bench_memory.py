"""Peak resident memory of the built-in default run, phase by phase, against the state it must hold.

    nice python benchmarks/bench_memory.py                  # 3 steps + one validation pass, fp32
    python benchmarks/bench_memory.py --steps 5 --no-validation
    python benchmarks/bench_memory.py --json mem.json actor_rollout_ref.rollout.n=8
    python benchmarks/bench_memory.py --lever adamw_8bit --rounds 2 --steps 3   # one lever off/on, interleaved
    python benchmarks/bench_memory.py --optimizer-step     # AdamW8bit (C kernel, torch ops) vs fused AdamW alone

The work: the built-in run (``posttrain/config/builtin.yaml``: SmolLM2-135M-Instruct from the
``smollm2`` extra, 8 arithmetic prompts x 4 samples, <= 24 new tokens, KL loss against the frozen
reference, one optimizer step per batch) at fp32 (``actor_rollout_ref.actor.fsdp_config.mixed_precision.
param_dtype=fp32`` and the ``ref`` one, the choice ``auto`` makes on a CPU without bf16 instructions),
with the process set up as ``posttrain train`` sets it (`posttrain.host.allocator`, `posttrain.host.threads`).
Memory is not timing: the figures do not depend on other load on the machine.

``--lever NAME`` (issue 41) measures one lever alone: the same run with the lever off and on, as
separate processes (a peak is a process's) alternated ``--rounds`` times (off, on, off, on: drift on
a shared machine falls on both), each printing its peaks and step times; then a table of the peak
(median over rounds) and the median step, generation and update seconds of each setting, with the
load average before and after. Levers: `LEVERS`. ``--optimizer-step`` times one optimizer step over
SmolLM2-135M's parameter shapes, `AdamW8bit` and torch's fused AdamW alternated in one process.

Printed: this process's resident memory before anything loads (interpreter and libraries), its peak
while the trainer is built (models loaded), the peak of each phase of each step (``memory/resident_gb/*``
of ``RLTrainer.train_step``), the peak of one validation pass over the held-out set (the default run
validates before training and every 5 steps), and the state the run must hold computed from the
model: weights, gradients and Adam's two moments of the actor, and the reference's weights, each
at 4 bytes per parameter.

With ``actor_rollout_ref.actor.fsdp_config.optimizer_offload=True`` the one-process placement also
runs the actor's rollout and update memory-first (`posttrain.distributed.placement.memory_first`: large
buffers in mappings of their own, the freed heap handed back after the phase). The built-in run at
fp32 with micro-batches of 16 peaked at 4.1-4.2 GB without it and 3.1-3.2 GB with it (2.5-2.7 GB with
micro-batches of 8); it cost ~x0.93 a step (fresh pages are zero-filled).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FP32 = ["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
        "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=fp32"]
QUIET = ["trainer.logger=[]", "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
         f"trainer.default_local_dir=/tmp/posttrain_bench/ckpt_{os.getpid()}"]  # its own lock, beside other runs
PHASES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "step")
LEVERS = {  # name -> (overrides with the lever off, overrides with it on)
    "adamw_8bit": (["actor_rollout_ref.actor.optim.optimizer=AdamW"],
                   ["actor_rollout_ref.actor.optim.optimizer=posttrain_adamw_8bit"]),
    "no_reference": (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.0"],
                     ["actor_rollout_ref.actor.use_kl_loss=False"]),
    "gradient_checkpointing": (["actor_rollout_ref.model.enable_gradient_checkpointing=False"],
                               ["actor_rollout_ref.model.enable_gradient_checkpointing=True"]),
    "paged_reference": (["actor_rollout_ref.ref.fsdp_config.param_offload=False"],
                        ["actor_rollout_ref.ref.fsdp_config.param_offload=True"]),
}


def state_bytes(actor, ref) -> dict[str, int]:
    """What the run must hold at fp32: the actor's weights, gradients and Adam moments, the reference's weights."""
    def params(module, trainable_only=False):
        seen = {id(p): p for p in module.parameters() if p.requires_grad or not trainable_only}  # tied weights once
        return sum(p.numel() for p in seen.values())

    trained = params(actor, trainable_only=True)
    return {"actor_weights": 4 * params(actor), "gradients": 4 * trained, "adam_moments": 8 * trained,
            "reference_weights": 4 * params(ref) if ref is not None else 0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    p.add_argument("--no-validation", action="store_true", help="skip the validation pass after the steps")
    p.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")
    p.add_argument("--lever", choices=sorted(LEVERS), help="measure this lever off and on (module docstring)")
    p.add_argument("--rounds", type=int, default=2, help="--lever: off/on pairs of runs (default 2)")
    p.add_argument("--optimizer-step", action="store_true", help="time AdamW8bit against fused AdamW alone")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides")
    a = p.parse_args(argv)
    if a.optimizer_step:
        return optimizer_step()
    if a.lever:
        return compare(a)

    from posttrain.host.allocator import keep_freed_memory
    from posttrain.host.threads import prefer_sleeping_threads

    prefer_sleeping_threads()  # as `posttrain train` sets the process up
    keep_freed = keep_freed_memory()
    from posttrain.host.resident import GB, current_resident_bytes, peak_resident_bytes

    start_gb = current_resident_bytes() / GB  # the interpreter alone, before torch
    import torch

    from posttrain.config import BUILTIN_CONFIG, load_config
    from posttrain.trainer.trainer import RLTrainer

    libraries_gb = current_resident_bytes() / GB
    config = load_config(overrides=QUIET + FP32 + [f"trainer.total_training_steps={a.steps}", *a.overrides],
                         base=BUILTIN_CONFIG)
    trainer = RLTrainer(config)
    load_peak_gb = peak_resident_bytes() / GB  # PhasePeaks reset the high-water mark only after this
    load_peak_gb = max(load_peak_gb, trainer.memory.run_peak / GB)
    after_load_gb = current_resident_bytes() / GB
    w = trainer.workers
    state = state_bytes(w.actor.module, getattr(w.ref, "module", None))
    rows = []
    for i in range(a.steps):
        trainer.global_step += 1
        m = trainer.train_step(trainer.data.train_loader.next_batch())
        row = {k: m.get(f"memory/resident_gb/{k}") for k in PHASES if f"memory/resident_gb/{k}" in m}
        row["tokens"] = float(trainer.last_batch["attention_mask"].sum())
        row["step_s"] = m["timing_s/step"]
        row.update({f"{k}_s": m[f"timing_s/{k}"] for k in ("gen", "ref", "update_actor") if f"timing_s/{k}" in m})
        rows.append(row)
        print(f"step {i + 1}/{a.steps}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k in PHASES)
              + f" GB ({int(row['tokens'])} tokens, {row['step_s']:.1f} s)", flush=True)
    val_gb = None
    if not a.no_validation:
        with trainer.memory("validation"):
            trainer.validate()
        val_gb = trainer.memory.phases["validation"] / GB
        print(f"validation ({len(trainer.data.val)} prompts): {val_gb:.2f} GB", flush=True)
    run_peak_gb = trainer.memory.take_metrics()["memory/peak_resident_gb"]
    state_gb = sum(state.values()) / GB
    phase_peak = {k: max(r[k] for r in rows if k in r) for k in PHASES if any(k in r for r in rows)}

    lines = [f"peak resident memory, built-in run at fp32 ({a.steps} steps; torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads, freed memory kept={keep_freed}, "
             f"MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX', 'unset')})",
             f"  interpreter alone            {start_gb:6.2f} GB",
             f"  + torch, transformers, ...   {libraries_gb:6.2f} GB",
             f"  trainer built (peak / after) {load_peak_gb:6.2f} / {after_load_gb:.2f} GB"]
    for k, gb in phase_peak.items():
        lines.append(f"  {k + ' (peak over steps)':29}{gb:6.2f} GB")
    if val_gb is not None:
        lines.append(f"  {'validation pass':29}{val_gb:6.2f} GB")
    lines.append(f"  run peak                     {run_peak_gb:6.2f} GB")
    lines.append(f"state it must hold at fp32: {state_gb:.2f} GB = " + " + ".join(
        f"{k.replace('_', ' ')} {v / GB:.2f}" for k, v in state.items())
        + f"; with the libraries: {state_gb + libraries_gb:.2f} GB")
    lines.append(f"beyond state + libraries: {run_peak_gb - state_gb - libraries_gb:+.2f} GB; "
                 f"target (issue 23) <= 3 GB: {'met' if run_peak_gb <= 3.0 else 'missed'}")
    print("\n".join(lines))
    if a.json:
        Path(a.json).write_text(json.dumps({"start_gb": start_gb, "libraries_gb": libraries_gb,
                                            "load_peak_gb": load_peak_gb, "after_load_gb": after_load_gb,
                                            "steps": rows, "phase_peak_gb": phase_peak, "validation_gb": val_gb,
                                            "run_peak_gb": run_peak_gb, "state_bytes": state,
                                            "keep_freed_memory": keep_freed}, indent=1))
    return 0


def compare(a) -> int:
    """``--lever``: the run with the lever off and on, alternated in separate processes."""
    import statistics
    import subprocess
    import tempfile

    off, on = LEVERS[a.lever]
    print(f"lever {a.lever}: off = {' '.join(off)} | on = {' '.join(on)}; load average before: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs", flush=True)
    results: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name, keys in (("off", off), ("on", on)):
                out = Path(tmp) / f"{name}{r}.json"
                cmd = [sys.executable, __file__, "--steps", str(a.steps), "--no-validation", "--json", str(out),
                       *keys, *a.overrides]
                print(f"round {r + 1}/{a.rounds}, lever {name}: {' '.join(cmd[1:])}", flush=True)
                subprocess.run(cmd, check=True)
                results[name].append(json.loads(out.read_text()))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'lever ' + a.lever:24}{'run peak GB':>12}{'step s':>9}{'gen s':>8}{'ref s':>8}{'update s':>10}")
    medians = {}
    for name, runs in results.items():
        steps = [row for run in runs for row in run["steps"][1:] or run["steps"]]  # the first step warms up
        med = {k: statistics.median(row.get(k, float("nan")) for row in steps)
               for k in ("step_s", "gen_s", "ref_s", "update_actor_s")}
        medians[name] = med
        peak = statistics.median(run["run_peak_gb"] for run in runs)
        print(f"{name:24}{peak:12.2f}{med['step_s']:9.2f}{med['gen_s']:8.2f}{med['ref_s']:8.2f}"
              f"{med['update_actor_s']:10.2f}")
    print(f"step time on/off: x{medians['on']['step_s'] / medians['off']['step_s']:.3f} "
          f"(medians over {a.rounds} runs x {max(a.steps - 1, 1)} steps each)")
    return 0


def optimizer_step(repeats: int = 5) -> int:
    """One optimizer step over SmolLM2-135M's parameter shapes: AdamW8bit (its C kernel, and its torch ops as
    where no C compiler builds the kernel) and fused AdamW alternated."""
    import statistics
    import time

    import torch

    from posttrain.optim.adamw8bit import AdamW8bit, state_bytes

    shapes = ([(49152, 576)] + [(576, 576)] * 60 + [(192, 576)] * 60 + [(1536, 576)] * 90 + [(576,)] * 61)
    gen = torch.Generator().manual_seed(0)
    made = {}
    makers = {"adamw_8bit C": lambda ps: AdamW8bit(ps, lr=1e-5, native=True),
              "adamw_8bit torch": lambda ps: AdamW8bit(ps, lr=1e-5, native=False),
              "AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-5, fused=True)}
    for name, make in makers.items():
        params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        made[name] = make(params)
    print(f"{sum(p.numel() for p in made['AdamW fused'].param_groups[0]['params']) / 1e6:.1f}M parameters, "
          f"{torch.get_num_threads()} threads, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    times = {name: [] for name in made}
    for _ in range(repeats):
        for name, opt in made.items():
            t = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t)
    for name, opt in made.items():
        print(f"  {name:16} step median {statistics.median(times[name][1:]):.3f} s (first {times[name][0]:.3f} s), "
              f"state {state_bytes(opt) / 1e9:.3f} GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
