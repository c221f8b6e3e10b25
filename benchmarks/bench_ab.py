"""One speed lever on and off in one trainer, alternating step by step (the machine's speed drifts
by up to 2x within minutes, so runs one after the other cannot attribute a 1.3x change).

    python benchmarks/bench_ab.py                          # compile_layers, 11 steps of bench_step.py's work, bf16
    python benchmarks/bench_ab.py --lever prefix           # actor.use_prefix_grouper (prompts encoded once)
    python benchmarks/bench_ab.py --lever beginning --precision fp32 --steps 9   # and their shared beginning once
    python benchmarks/bench_ab.py --lever prefix --with compile --steps 9 --off-first
    python benchmarks/bench_ab.py --steps 15 --off-first --precision fp32
    python benchmarks/bench_ab.py --lever lean --precision fp32   # the hf engine's lean decoder
    python benchmarks/bench_ab.py --lever offload --precision fp32   # reference and AdamW moments paged to a file

Levers: ``compile`` (``actor_rollout_ref.model.compile_layers``: the first step compiles and is
reported, not counted), ``prefix`` (``actor_rollout_ref.actor.use_prefix_grouper``, the
reference following), ``beginning`` (with the grouper on throughout: the beginning all prompts of a
micro-batch share encoded once, on, or once per prompt, off), ``lean`` (the ``hf`` engine's lean decoder, off as with
``actor_rollout_ref.rollout.lean_decode=False``), ``offload`` (the reference's ``param_offload`` and the
actor's ``optimizer_offload``: paged to a file between uses on a CPU run, the rollout's and update's
large buffers in mappings of their own; off, the same file-backed memory stays resident, is stepped
all at once, and freed memory stays in the heap) and
``micro8``/``micro32`` (the actor's update in micro-batches of 8 or 32 responses instead of 16). ``--with`` keeps another lever on throughout. After the first step, steps
alternate off / on and the median of each phase (``timing_s/*``) is printed for both, with their
ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from posttrain.host.threads import choose_wait_policy  # noqa: E402  (imports no torch)

choose_wait_policy()  # as bench_step.py and the posttrain CLI, before torch loads

PHASES = ("gen", "ref", "update_actor", "step")
LEVERS = {"compile": ["actor_rollout_ref.model.compile_layers=True"],
          "prefix": ["actor_rollout_ref.actor.use_prefix_grouper=True"],
          "beginning": ["actor_rollout_ref.actor.use_prefix_grouper=True"],
          "lean": ["actor_rollout_ref.rollout.lean_decode=True"],
          "offload": ["actor_rollout_ref.ref.fsdp_config.param_offload=True",
                      "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True"],
          "micro8": [], "micro32": []}
MICRO_OFF, MICRO_ON = 16, {"micro8": 8, "micro32": 32}
"""``micro8``/``micro32``: the actor's update in micro-batches of 8 / 32 responses (on) instead of 16 (off)."""


_kept: dict = {}


def _switch(trainer, lever: str, on: bool) -> None:
    """Turn ``lever`` on or off in a running trainer's actor and reference."""
    from posttrain.models.compile import disable_layer_compile, enable_layer_compile

    if lever == "lean":
        trainer.workers.actor.rollout.lean_decode = on
        return
    if lever == "beginning":
        from posttrain.models import shared_prefix

        rule = _kept.setdefault("shared_beginning", shared_prefix.shared_beginning)  # the layout's own rule
        shared_prefix.shared_beginning = rule if on else (lambda *args: 0)
        return
    if lever in MICRO_ON:
        trainer.workers.actor.config.ppo_micro_batch_size_per_gpu = MICRO_ON[lever] if on else MICRO_OFF
        return
    if lever == "offload":  # off: the same memory, never paged out (resident like any other) and no trims
        import torch

        from posttrain.host.paging import PAGED_WEIGHTS_ATTR, paged_weights
        from posttrain.optim.paged import PagedAdamW

        actor = trainer.workers.actor
        if not hasattr(actor, "paged_optimizer"):
            actor.paged_optimizer = paged = actor.optimizer
            assert isinstance(paged, PagedAdamW)
            plain = torch.optim.AdamW(paged.param_groups, fused=True)  # torch's step over the same groups and state
            plain.param_groups, plain.state = paged.param_groups, paged.state
            actor.plain_optimizer = plain
        actor.optimizer = actor.paged_optimizer if on else actor.plain_optimizer  # with it, the actor's memory-first mode
        ref = trainer.workers.ref.module  # off: the placement finds no paged weights to drop after a pass
        kept = _kept.setdefault("ref_pages", paged_weights(ref))
        object.__setattr__(ref, PAGED_WEIGHTS_ATTR, kept if on else None)
        return
    workers = [w for w in (trainer.workers.actor, trainer.workers.ref) if w is not None]
    for worker in workers:
        if lever == "compile":
            (enable_layer_compile if on else disable_layer_compile)(worker.module)
        else:
            worker.config.use_prefix_grouper = on


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lever", choices=sorted(LEVERS), default="compile")
    p.add_argument("--with", dest="also", choices=sorted(LEVERS), action="append", default=[],
                   help="another lever kept on in every step")
    p.add_argument("--steps", type=int, default=11, help="steps in all, the first is not counted (default 11)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--off-first", "--eager-first", action="store_true", help="after the first step, start with the lever off")
    a = p.parse_args(argv)

    import bench_step
    from posttrain.host.allocator import keep_freed_memory
    from posttrain.trainer.trainer import RLTrainer

    keep_freed_memory()
    rates = bench_step.measure_rates()
    print(f"load average {os.getloadavg()}; bf16 rate {rates['bf16'] / 1e12:.2f}, fp32 {rates['fp32'] / 1e12:.2f} TFLOP/s; "
          f"lever {a.lever}" + (f", always on: {', '.join(a.also)}" if a.also else ""), flush=True)
    levers = sorted({a.lever, *a.also})
    config, _ = bench_step.build_config(a.precision, a.steps, [o for name in levers for o in LEVERS[name]])
    trainer = RLTrainer(config)
    rows: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for i in range(a.steps):
        on = i == 0 or (i % 2 == 1) != a.off_first
        _switch(trainer, a.lever, on)
        trainer.global_step += 1
        metrics = trainer.train_step(trainer.data.train_loader.next_batch())
        row = {k: metrics.get(f"timing_s/{k}", 0.0) for k in PHASES}
        mode = "on" if on else "off"
        print(f"step {i + 1} {a.lever} {mode:3}" + "".join(f"  {k} {v:6.2f}" for k, v in row.items())
              + ("  (first: not counted)" if i == 0 else ""), flush=True)
        if i > 0:
            rows[mode].append(row)
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in PHASES} for mode, rs in rows.items() if rs}
    if len(med) == 2:
        print(f"median of {len(rows['off'])} steps off / {len(rows['on'])} on ({a.lever}):")
        for k in PHASES:
            print(f"  {k:13} off {med['off'][k]:6.2f} s  on {med['on'][k]:6.2f} s  "
                  f"x{med['off'][k] / max(med['on'][k], 1e-9):.2f}")
    print(f"load average {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
