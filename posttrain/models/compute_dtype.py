"""``mixed_precision.param_dtype=auto``: compute in bf16 or fp32, whichever this machine runs faster.

Machines differ more than a default can: on one CPU here (Zen 4, AVX512-BF16, no AMX) bf16 autocast
ran a training step 4.5x slower than fp32; on another (AMD family 26) 1.9x faster. So ``auto``
times one forward + backward of the actual model on a small batch in each precision, the same
computation training runs (`response_logprobs`), and keeps the faster. The answer is cached per
machine (CPU model, torch version, threads) and model shape in ``~/.cache/posttrain/precision.json``
(``POSTTRAIN_CACHE_DIR`` moves it), so later runs start at once. On CUDA ``auto`` is bf16.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from posttrain.models.precision import autocast_context

__all__ = ["CHOICES", "choose_param_dtype", "resolve_param_dtype"]

CHOICES = ("bf16", "fp32")
PROBE_ROWS, PROBE_TOKENS, PROBE_RESPONSE = 4, 128, 32
"""The timed batch: 4 rows of 128 tokens, the last 32 scored (well under a second for a 135M model)."""


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # a diagnostic: stdout may carry a result (eval --json)


def resolve_param_dtype(requested: str, module: nn.Module, device: torch.device,
                        log: Callable[[str], None] = _to_stderr) -> str:
    """``requested`` unless it is ``auto``; then the measured (or cached) faster of bf16 and fp32."""
    if requested != "auto":
        return requested
    choice, why = choose_param_dtype(module, device)
    log(f"compute precision: {choice} (mixed_precision.param_dtype=auto: {why})")
    return choice


def choose_param_dtype(module: nn.Module, device: torch.device, cache_dir: str | os.PathLike | None = None,
                       timer: Callable[[nn.Module, torch.device, str], float] | None = None) -> tuple[str, str]:
    """(``bf16`` or ``fp32``, why). CUDA: bf16. CPU: the faster one measured, or the cached answer."""
    if torch.device(device).type == "cuda":
        return "bf16", "CUDA tensor cores"
    timer = timer or time_train_step
    path = _cache_file(cache_dir)
    key = _machine_key(module)
    cached = _read_cache(path).get(key)
    if cached in CHOICES:
        return cached, f"measured before on this machine and model, cached in {path}"
    wall, cpu = time.perf_counter(), time.process_time()
    seconds = {dtype: timer(module, torch.device(device), dtype) for dtype in CHOICES}
    share = _core_share(time.perf_counter() - wall, time.process_time() - cpu)
    choice = "bf16" if seconds["bf16"] < seconds["fp32"] else "fp32"
    timed = (f"one training forward + backward took {seconds['bf16']:.3f} s in bf16 and "
             f"{seconds['fp32']:.3f} s in fp32 on {PROBE_ROWS}x{PROBE_TOKENS} tokens")
    if share is not None and share < BUSY_SHARE:  # other processes had the cores: the ratio may be off
        return choice, (f"{timed}; not cached: this process got {share:.0%} of its {torch.get_num_threads()} "
                        "threads' CPU time while timing (a busy machine), so the next run measures again")
    _write_cache(path, key, choice)
    return choice, f"{timed}; cached in {path}"


BUSY_SHARE = 0.5
"""Below this share of its threads' CPU time while timing, the machine counts as busy (a quiet
2-core machine gives this process 70-95%: the Python between kernels runs on one thread)."""


def _core_share(wall_s: float, cpu_s: float) -> float | None:
    """CPU seconds per wall second per torch thread while timing; None when too short to judge."""
    if wall_s < 0.2:
        return None
    return cpu_s / wall_s / max(torch.get_num_threads(), 1)


def time_train_step(module: nn.Module, device: torch.device, dtype: str, repeats: int = 2) -> float:
    """Best of ``repeats`` timed forward + backward passes (after one warm-up) on a random batch: the
    response log-probs of a causal LM, or the hidden states of a backbone (the critic's); the
    gradients are dropped and the module's train/eval mode restored."""
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
            if attempt:  # the first pass warms up kernels and the allocator
                best = min(best, time.perf_counter() - start)
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
    parts = [_cpu_name(), torch.__version__, str(torch.get_num_threads()), json.dumps(shape, sort_keys=True),
             str(trainable)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line  # the first of the two: a model name, or on some CPUs only the flags
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_file(cache_dir: str | os.PathLike | None) -> Path:
    root = cache_dir or os.environ.get("POSTTRAIN_CACHE_DIR") or Path.home() / ".cache" / "posttrain"
    return Path(root) / "precision.json"


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # no cache yet, or a damaged one: measure again


def _write_cache(path: Path, key: str, choice: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**_read_cache(path), key: choice}
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the next run measures again
