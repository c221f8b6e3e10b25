"""A GSM8K-shaped GRPO step, phase by phase, for posttrain and for TRL's GRPOTrainer on the same work.

    python benchmarks/bench_gsm8k_step.py                        # 8 prompts x 5, <= 256 new tokens, 3 steps, fp32
    python benchmarks/bench_gsm8k_step.py --steps 1 --prompts 2 --max-response 16   # a smoke test
    python benchmarks/bench_gsm8k_step.py --skip-trl --json gsm8k.json
    python benchmarks/bench_gsm8k_step.py --precision bf16

The work (issue 23's GSM8K shape, beside `bench_step.py`'s arithmetic one): SmolLM2-135M-Instruct
(the ``smollm2`` extra), ``--prompts`` GSM8K training questions per step (from ``--data``, prepared
as ``posttrain prep gsm8k`` does: verl's instruction appended, the ``#### N`` answer as ground
truth) x n=5 samples, up to 256 new tokens at temperature 1, the GSM8K scorer as reward, GRPO with a
KL loss (coefficient 0.001) against the frozen reference, one optimizer step per batch (on-policy:
no separate old-log-prob pass on either side). Both frameworks get the same prompts in the same
order. The first step is warm-up and is not counted when there are more.

Per step and framework: seconds of generation, reference log-probs, the update (forward, backward,
optimizer step) and the whole step, with the generated tokens (answers are sampled, so lengths
differ between the two; tokens/s of generation makes them comparable). posttrain's phases are its
``timing_s/*`` metrics; TRL's are timed by wrapping its ``_generate`` (generation),
``_get_per_token_logps_and_entropies`` on the reference model (reference) and ``_prepare_inputs``
(generation, scoring and reference together; the rest of the step is the update). Then the
posttrain/TRL step-time ratio (issue 23's target: <= 0.5).

posttrain runs with its built-in run's settings (``posttrain/config/builtin.yaml``: prompts shared by
their 5 responses, no gradient checkpointing) and ``--micro-batch`` rows per update micro-batch;
TRL with its defaults (gradient checkpointing on; ``--trl-no-gradient-checkpointing`` turns it off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from posttrain.host.threads import choose_wait_policy  # noqa: E402  (imports no torch)

if "--omp-wait-policy" not in " ".join(sys.argv):  # as bench_step.py: posttrain's choice, both frameworks
    choose_wait_policy()

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "gsm8k"
PREPARED = Path("/tmp/posttrain_bench/gsm8k")
N_SAMPLES = 5
KL_COEF = 0.001


def prepared_gsm8k(source: Path, dst: Path = PREPARED) -> Path:
    """``train.parquet`` / ``test.parquet`` in verl's schema from GSM8K's jsonl (``posttrain prep gsm8k``), once."""
    if not (dst / "train.parquet").is_file():
        if not (source / "train.jsonl").is_file():
            raise SystemExit(f"--data {source}: no train.jsonl there (GSM8K's files: train.jsonl, test.jsonl)")
        from posttrain.data.prep import main as prep_main

        if prep_main(["gsm8k", "--input", str(source), "--output", str(dst)]) != 0:
            raise SystemExit(f"posttrain prep gsm8k --input {source} failed")
    return dst


def posttrain_overrides(data: Path, a: argparse.Namespace) -> list[str]:
    dtype = a.precision
    return [f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
            f"data.train_batch_size={a.prompts}", "data.max_prompt_length=512",
            f"data.max_response_length={a.max_response}", f"actor_rollout_ref.rollout.n={N_SAMPLES}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={a.prompts}", "actor_rollout_ref.actor.ppo_epochs=1",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={a.micro_batch}",
            "actor_rollout_ref.actor.use_kl_loss=True", f"actor_rollout_ref.actor.kl_loss_coef={KL_COEF}",
            "algorithm.use_kl_in_reward=False",
            f"actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype={dtype}",
            f"actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype={dtype}",
            "trainer.logger=[]", "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
            f"trainer.default_local_dir=/tmp/posttrain_bench/ckpt_{os.getpid()}",  # its own lock, beside other runs
            f"trainer.total_training_steps={a.steps}", *a.overrides]


def run_posttrain(data: Path, a: argparse.Namespace, log=print) -> dict[str, Any]:
    from posttrain.config import BUILTIN_CONFIG, load_config
    from posttrain.trainer.trainer import RLTrainer

    overrides = posttrain_overrides(data, a)
    trainer = RLTrainer(load_config(overrides=overrides, base=BUILTIN_CONFIG))
    rows, prompts = [], _next_prompts(trainer, a.steps)
    for i in range(a.steps):
        trainer.global_step += 1
        m = trainer.train_step(trainer.data.train_loader.next_batch())
        row = {"gen": m["timing_s/gen"], "ref": m.get("timing_s/ref", 0.0), "update": m["timing_s/update_actor"],
               "step": m["timing_s/step"], "response_tokens": float(trainer.last_batch["response_mask"].sum()),
               "score": m["critic/score/mean"]}
        rows.append(row)
        log(f"  posttrain step {i + 1}/{a.steps}: {_phases(row)}")
    return {"per_step": rows, "mean": _mean(rows), "prompts": prompts, "overrides": overrides}


def _next_prompts(trainer, steps: int) -> list[dict]:
    """The chat prompts and GSM8K answers of the train loader's next ``steps`` batches, in order."""
    sampler, train = trainer.data.train_loader.sampler, trainer.data.train
    order = [i for e in range(sampler.epoch, sampler.epoch + 2) for i in sampler.epoch_order(e)]
    first = sampler.position * sampler.batch_size
    return [{"prompt": list(train.rows[i]["prompt"]), "ground_truth": train.rows[i]["reward_model"]["ground_truth"]}
            for i in order[first:first + steps * sampler.batch_size]]


def run_trl(prompts: list[dict], a: argparse.Namespace, log=print) -> dict[str, Any]:
    """TRL's GRPOTrainer on ``prompts`` (in order, ``a.prompts`` per step), its phases timed by wrapping
    its methods on the instance."""
    import datasets
    import trl
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl_grpo import _quiet, grpo_config_kwargs, prepare_hf_model

    from posttrain.rewards import gsm8k

    _quiet()
    path = prepare_hf_model(None)
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    ds = datasets.Dataset.from_list(prompts)

    def gsm8k_reward(completions, ground_truth, **kwargs):
        texts = [c if isinstance(c, str) else " ".join(m.get("content") or "" for m in c) for c in completions]
        return [float(gsm8k.compute_score(t, g)) for t, g in zip(texts, ground_truth)]

    kwargs = grpo_config_kwargs("/tmp/posttrain_bench/trl_gsm8k_out", a.steps, a.precision == "bf16",
                                not a.trl_no_gradient_checkpointing)
    kwargs.update(per_device_train_batch_size=a.prompts * N_SAMPLES, num_generations=N_SAMPLES,
                  max_completion_length=a.max_response, beta=KL_COEF, shuffle_dataset=False)
    phases = {"gen": [], "ref": [], "prepare": [], "tokens": []}

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.step_s: list[float] = []

        def on_step_begin(self, args, state, control, **kw):  # noqa: ARG002
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # noqa: ARG002
            self.step_s.append(time.perf_counter() - self.t0)

    timer = StepTimer()
    trainer = GRPOTrainer(model=path, reward_funcs=gsm8k_reward, args=GRPOConfig(**kwargs), train_dataset=ds,
                          processing_class=tok, callbacks=[timer])
    trainer.remove_callback(PrinterCallback)
    _time_method(trainer, "_generate", phases["gen"], on_result=lambda out: phases["tokens"].append(
        float(sum(len(ids) for ids in out[1]))))
    _time_method(trainer, "_get_per_token_logps_and_entropies", phases["ref"],
                 when=lambda model, *args, **kw: model is trainer.ref_model)
    _time_method(trainer, "_prepare_inputs", phases["prepare"])
    trainer.train()
    rows = []
    for i, step_s in enumerate(timer.step_s):
        gen, ref, prepare = phases["gen"][i], sum(phases["ref"][i:i + 1]), phases["prepare"][i]
        rows.append({"gen": gen, "ref": ref, "update": step_s - prepare, "step": step_s,
                     "response_tokens": phases["tokens"][i]})
        log(f"  TRL step {i + 1}/{a.steps}: {_phases(rows[-1])}")
    return {"per_step": rows, "mean": _mean(rows), "trl_version": trl.__version__,
            "gradient_checkpointing": not a.trl_no_gradient_checkpointing}


def _time_method(obj: Any, name: str, into: list, when=None, on_result=None) -> None:
    """Replace ``obj.name`` with a wrapper that appends each call's seconds to ``into`` (only calls for
    which ``when(*args)`` is true, when given) and hands the result to ``on_result``."""
    original = getattr(obj, name)

    def timed(*args, **kwargs):
        if when is not None and not when(*args, **kwargs):
            return original(*args, **kwargs)
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        into.append(time.perf_counter() - t0)
        if on_result is not None:
            on_result(out)
        return out

    setattr(obj, name, timed)


def _mean(rows: list[dict]) -> dict[str, float]:
    measured = rows[1:] if len(rows) > 1 else rows
    return {k: statistics.fmean(r[k] for r in measured) for k in rows[0]}


def _phases(row: dict) -> str:
    return (f"step {row['step']:.2f} s (gen {row['gen']:.2f}, ref {row['ref']:.2f}, update {row['update']:.2f}; "
            f"{int(row['response_tokens'])} response tokens)")


def format_table(res: dict[str, Any], a: argparse.Namespace) -> str:
    runs = {name: r for name, r in (("posttrain", res.get("posttrain")), ("TRL", res.get("trl"))) if r}
    lines = [f"GSM8K-shaped GRPO step: {a.prompts} prompts x {N_SAMPLES}, <= {a.max_response} new tokens, KL loss "
             f"{KL_COEF}, {a.precision}, {a.steps} steps ({'first = warm-up' if a.steps > 1 else 'no warm-up'}), "
             f"torch threads {res['torch_threads']}, OMP_WAIT_POLICY={res.get('omp_wait_policy') or 'unset'}, "
             f"load avg before/after {res['load_before']} / {res['load_after']}",
             f"{'':28}" + "".join(f"{name:>14}" for name in runs)]
    for key, label in (("gen", "generation s"), ("ref", "reference s"), ("update", "update s"), ("step", "step s"),
                       ("response_tokens", "response tokens")):
        lines.append(f"{label:28}" + "".join(f"{r['mean'][key]:14.2f}" for r in runs.values()))
    lines.append(f"{'gen tokens/s':28}" + "".join(
        f"{r['mean']['response_tokens'] / max(r['mean']['gen'], 1e-9):14.1f}" for r in runs.values()))
    if len(runs) == 2:
        ratio = runs["posttrain"]["mean"]["step"] / runs["TRL"]["mean"]["step"]
        gen = runs["posttrain"]["mean"]["gen"] / runs["TRL"]["mean"]["gen"]
        gc = "on" if runs["TRL"]["gradient_checkpointing"] else "off"
        lines.append(f"posttrain / TRL {runs['TRL']['trl_version']} (its gradient checkpointing {gc}): step "
                     f"{ratio:.3f}x (target <= 0.5: {'met' if ratio <= 0.5 else 'missed'}), generation {gen:.3f}x")
    return "\n".join(lines)


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="steps per framework; the first is warm-up (default 3)")
    p.add_argument("--prompts", type=int, default=8, help="GSM8K questions per step (default 8; x5 samples)")
    p.add_argument("--max-response", type=int, default=256, help="new tokens at most (default 256)")
    p.add_argument("--micro-batch", type=int, default=5,
                   help="posttrain's actor update micro-batch rows (default 5: one question's 5 answers, ~1.2k-2.3k "
                        "tokens, so the activations held stay near 2-3 GB at fp32)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="both frameworks (default fp32)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"GSM8K's jsonl folder (default {DEFAULT_DATA})")
    p.add_argument("--skip-trl", action="store_true", help="posttrain only")
    p.add_argument("--trl-no-gradient-checkpointing", action="store_true", help="TRL without gradient checkpointing")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, the core count)")
    p.add_argument("--omp-wait-policy", choices=["passive", "active"], default=None,
                   help="OpenMP wait policy (default: posttrain's choice; re-executes the script to apply it)")
    p.add_argument("--json", metavar="FILE", help="also write all numbers as JSON")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for posttrain")
    a = p.parse_args(argv)
    if a.steps < 1 or a.prompts < 1 or a.max_response < 1:
        raise SystemExit("--steps, --prompts and --max-response must be >= 1")
    if a.omp_wait_policy and os.environ.get("OMP_WAIT_POLICY", "").lower() != a.omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = a.omp_wait_policy.upper()
        os.execv(sys.executable, [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)])

    import importlib.util

    import torch

    from posttrain.host.allocator import keep_freed_memory

    keep_freed_memory()  # as `posttrain train`; TRL runs in this process with the same setting
    if a.threads:
        torch.set_num_threads(a.threads)
    data = prepared_gsm8k(a.data)
    res: dict[str, Any] = {"load_before": _load(), "torch_threads": torch.get_num_threads(),
                           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""), "args": vars(a) | {
        "data": str(a.data)}}
    print(f"posttrain: {a.steps} steps", flush=True)
    res["posttrain"] = run_posttrain(data, a)
    if not a.skip_trl:
        if importlib.util.find_spec("trl") is None:
            print("trl is not installed (pip install 'posttrain[bench]'): skipping TRL", flush=True)
        else:
            print(f"TRL: {a.steps} steps", flush=True)
            res["trl"] = run_trl(res["posttrain"]["prompts"], a)
    res["load_after"] = _load()
    print(format_table(res, a))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
