"""``mixed_precision.param_dtype=auto``: compute in bf16 or fp32, whichever this machine runs faster.

Machines differ more than a default can: bf16 autocast ran a training step several times slower
than fp32 on one CPU with bf16 instructions, faster on another, and many times slower on a CPU
without them, where bf16 is emulated (figures and machines in benchmarks/README.md, "Compute
precision"; ``benchmarks/bench_step.py --precisions bf16,fp32`` compares the two on the built-in
work). So ``auto`` decides in three steps:

1. The CPU's capabilities first (`cpu_bf16_support`): without bf16 instructions (x86: ``amx_bf16`` or
   ``avx512_bf16``; ARM: ``bf16``) the answer is fp32 at once, nothing timed.
2. Otherwise one forward + backward of the actual model on a small batch (the computation training
   runs, `response_logprobs`) is timed in fp32, then in bf16; timing bf16 stops as soon as one pass is
   clearly slower than fp32's best, and the whole measurement is bounded (`BUDGET_S`).
3. The answer and its measurements are cached per machine (CPU model, torch version, threads) and
   model shape in ``~/.cache/posttrain/precision.json`` (``POSTTRAIN_CACHE_DIR`` moves it; delete
   the file to measure again), so later runs start at once. A measurement taken while other
   processes held the cores is cached too (never re-timed at every start) and says so in the file.

On CUDA ``auto`` is bf16.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from posttrain.host.cache import cache_root, machine_key, read_answers, write_answer
from posttrain.host.cpu import BF16_FLAGS, cpu_bf16_support  # noqa: F401 - the machine's probe, read here too
from posttrain.models.precision import autocast_context

__all__ = ["BUDGET_S", "CHOICES", "choose_param_dtype", "cpu_bf16_support", "resolve_param_dtype",
           "time_train_step"]

CHOICES = ("bf16", "fp32")
PROBE_ROWS, PROBE_TOKENS, PROBE_RESPONSE = 2, 128, 32
"""The timed batch: 2 rows of 128 tokens, the last 32 scored (small, so that a 135M model on 2 cores
times both precisions within `BUDGET_S`)."""
BUDGET_S = 4.0
"""The most the measurement may take; passes stop once it is spent (the answer uses what was timed)."""
CLEARLY_SLOWER = 1.3
"""A bf16 pass this many times fp32's best ends the bf16 timing: more passes would not change the answer."""

def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # a diagnostic: stdout may carry a result (eval --json)


def resolve_param_dtype(requested: str, module: nn.Module, device: torch.device,
                        log: Callable[[str], None] = _to_stderr) -> str:
    """``requested`` unless it is ``auto``; then the faster of bf16 and fp32 (known, cached or measured)."""
    if requested != "auto":
        return requested
    choice, why = choose_param_dtype(module, device, log=log)
    log(f"compute precision: {choice} (mixed_precision.param_dtype=auto: {why})")
    return choice


def choose_param_dtype(module: nn.Module, device: torch.device, cache_dir: str | os.PathLike | None = None,
                       timer: Callable[..., float] | None = None,
                       support: tuple[bool, str] | None = None,
                       log: Callable[[str], None] = _to_stderr) -> tuple[str, str]:
    """(``bf16`` or ``fp32``, why). CUDA: bf16. CPU without bf16 instructions: fp32, nothing timed.
    Otherwise the cached answer, or the faster one measured within `BUDGET_S`.

    ``timer(module, device, dtype, give_up_after=..., deadline=...)`` times one precision
    (`time_train_step`);
    ``support`` replaces `cpu_bf16_support`'s reading (tests)."""
    if torch.device(device).type == "cuda":
        return "bf16", "CUDA tensor cores"
    capable, flags = support or cpu_bf16_support()
    if not capable:
        return "fp32", flags
    path = _cache_file(cache_dir)
    key = _machine_key(module)
    cached = read_answers(path).get(key)
    cached_choice = cached.get("choice") if isinstance(cached, dict) else cached  # first form: the bare answer
    if cached_choice in CHOICES:
        return cached_choice, f"measured before on this machine and model, cached in {path}"
    log(f"compute precision: timing one training forward + backward in fp32 and bf16 ({flags}; "
        f"at most {BUDGET_S:.0f} s, once per machine and model)")
    choice, seconds, share = _measure(module, torch.device(device), timer or time_train_step)
    busy = share is not None and share < BUSY_SHARE
    write_answer(path, key, {"choice": choice, "seconds": seconds, "cpu_share": share, "busy": busy,
                             "measured": time.strftime("%Y-%m-%d %H:%M:%S")})
    timed = (f"one training forward + backward took {_fmt(seconds['bf16'])} in bf16 and "
             f"{_fmt(seconds['fp32'])} in fp32 on {PROBE_ROWS}x{PROBE_TOKENS} tokens")
    if busy:  # other processes had the cores: the ratio may be off
        return choice, (f"{timed}; measured on a busy machine (this process got {share:.0%} of its "
                        f"{torch.get_num_threads()} threads' CPU time); cached in {path}: delete it to "
                        "measure again on a quiet machine")
    return choice, f"{timed}; cached in {path}"


def _measure(module: nn.Module, device: torch.device, timer: Callable[..., float]
             ) -> tuple[str, dict[str, float], float | None]:
    """fp32 first (the safe answer), then bf16, stopped once clearly slower; no pass starts after the
    budget is spent."""
    wall, cpu = time.perf_counter(), time.process_time()
    deadline = wall + BUDGET_S
    fp32 = timer(module, device, "fp32", deadline=wall + BUDGET_S / 2)
    bf16 = timer(module, device, "bf16", give_up_after=CLEARLY_SLOWER * fp32, deadline=deadline)
    share = _core_share(time.perf_counter() - wall, time.process_time() - cpu)
    return ("bf16" if bf16 < fp32 else "fp32"), {"bf16": bf16, "fp32": fp32}, share


def _fmt(seconds: float) -> str:
    return f"{seconds:.3f} s"


BUSY_SHARE = 0.5
"""Below this share of its threads' CPU time while timing, the machine counts as busy (a quiet
2-core machine gives this process well above it, though not all: the Python between kernels runs on
one thread; benchmarks/README.md, "Compute precision")."""


def _core_share(wall_s: float, cpu_s: float) -> float | None:
    """CPU seconds per wall second per torch thread while timing; None when too short to judge."""
    if wall_s < 0.2:
        return None
    return cpu_s / wall_s / max(torch.get_num_threads(), 1)


def time_train_step(module: nn.Module, device: torch.device, dtype: str, repeats: int = 2,
                    give_up_after: float = float("inf"), deadline: float | None = None) -> float:
    """Best of ``repeats`` timed forward + backward passes (after one warm-up) on a random batch: the
    response log-probs of a causal LM, or the hidden states of a backbone (the critic's); the
    gradients are dropped and the module's train/eval mode restored.

    At least one timed pass runs (a warm-up's time includes one-time costs that would bias the
    comparison); after it, timing stops once a pass was slower than ``give_up_after`` seconds (this
    precision is clearly not the faster one) or ``time.perf_counter()`` has passed ``deadline``."""
    vocab = module.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (PROBE_ROWS, PROBE_TOKENS), generator=generator).to(device)
    was_training = module.training
    module.train()
    best = float("inf")
    try:
        for attempt in range(repeats + 1):
            start = time.perf_counter()
            with autocast_context(device, dtype):
                out = _forward(module, ids)
            out.float().sum().backward()
            took = time.perf_counter() - start
            if not attempt:  # the first pass warms up kernels and the allocator
                continue
            best = min(best, took)
            if took > give_up_after or (deadline is not None and time.perf_counter() > deadline):
                break
    finally:
        module.zero_grad(set_to_none=True)
        module.train(was_training)
    return best


def _forward(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from posttrain.models.logprobs import response_logprobs, split_lm

    mask = torch.ones_like(ids)
    positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    if split_lm(module) is not None:  # the training computation: chunked log-probs of response tokens
        return response_logprobs(module, ids, mask, positions, ids[:, -PROBE_RESPONSE:])[0]
    return module(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state


def _machine_key(module: nn.Module) -> str:
    config = getattr(module, "config", None)
    shape = {k: getattr(config, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers",
                                                   "intermediate_size", "vocab_size")}
    # what trains matters too: LoRA (a few trainable adapters) and full fine-tuning backpropagate differently
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return machine_key(torch.__version__, str(torch.get_num_threads()), json.dumps(shape, sort_keys=True),
                       str(trainable))


def _cache_file(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir or cache_root()) / "precision.json"
