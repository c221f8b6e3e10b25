"""``compile_layers`` on and off in one trainer, alternating step by step (the machine's speed drifts
by up to 2x within minutes, so runs one after the other cannot attribute a 1.3x change).

    python benchmarks/bench_compile.py                 # 11 steps of bench_step.py's work, bf16
    python benchmarks/bench_compile.py --steps 15 --eager-first --precision fp32

The first step compiles (reported, not counted); then steps alternate eager / compiled, and the
median of each phase (``timing_s/*``) is printed for both, with their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench_step.py and the posttrain CLI
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PHASES = ("gen", "ref", "update_actor", "step")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=11, help="steps in all, the first compiles (default 11)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--eager-first", action="store_true", help="after the compiling step, start with eager")
    a = p.parse_args(argv)

    import bench_step
    from posttrain.allocator import keep_freed_memory
    from posttrain.models.compile import disable_layer_compile, enable_layer_compile
    from posttrain.trainer.trainer import RLTrainer

    keep_freed_memory()
    rates = bench_step.measure_rates()
    print(f"load average {os.getloadavg()}; bf16 rate {rates['bf16'] / 1e12:.2f}, fp32 {rates['fp32'] / 1e12:.2f} TFLOP/s",
          flush=True)
    config, _ = bench_step.build_config(a.precision, a.steps, ["actor_rollout_ref.model.compile_layers=True"])
    trainer = RLTrainer(config)
    modules = [trainer.workers.actor.module] + ([trainer.workers.ref.module] if trainer.workers.ref else [])
    rows: dict[str, list[dict[str, float]]] = {"eager": [], "compiled": []}
    for i in range(a.steps):
        compiled = i == 0 or (i % 2 == 1) != a.eager_first
        for module in modules:
            (enable_layer_compile if compiled else disable_layer_compile)(module)
        trainer.global_step += 1
        metrics = trainer.train_step(trainer.data.train_loader.next_batch())
        row = {k: metrics.get(f"timing_s/{k}", 0.0) for k in PHASES}
        mode = "compiled" if compiled else "eager"
        print(f"step {i + 1} {mode:8}" + "".join(f"  {k} {v:6.2f}" for k, v in row.items())
              + ("  (compiles)" if i == 0 else ""), flush=True)
        if i > 0:
            rows[mode].append(row)
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in PHASES} for mode, rs in rows.items() if rs}
    if len(med) == 2:
        print(f"median of {len(rows['eager'])} eager / {len(rows['compiled'])} compiled steps:")
        for k in PHASES:
            print(f"  {k:13} eager {med['eager'][k]:6.2f} s  compiled {med['compiled'][k]:6.2f} s  "
                  f"x{med['eager'][k] / max(med['compiled'][k], 1e-9):.2f}")
    print(f"load average {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
