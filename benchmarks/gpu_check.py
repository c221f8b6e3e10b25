"""One-GPU check of posttrain's FSDP2 path: a GRPO-like step on a random ~0.5B Qwen2, per memory setting.

    python benchmarks/gpu_check.py                          # CUDA: FSDP2 world size 1 (NCCL), bf16
    python benchmarks/gpu_check.py --json gpu_check.json    # also write the summary to a file
    python benchmarks/gpu_check.py --tiny                   # CPU smoke test (gloo, fp32, tiny model)

Needs torch, transformers and posttrain only (no Ray, no vLLM, no downloads): the model is
``Qwen2ForCausalLM`` built from a Qwen2.5-0.5B-shaped ``Qwen2Config`` with random weights, and
prompts are random token ids (a random model almost never emits EOS, so every response has the
full length and the work is the same each run).

Per setting (``--settings``; default all four): ``base``; ``ckpt`` (gradient checkpointing);
``offload`` (``param_offload`` + ``optimizer_offload``: parameters and AdamW state in CPU memory
between phases, moved in for each phase); ``offload_ckpt`` (both); optionally ``offload_policy``
(``fsdp_config.offload_policy``: FSDP2's ``CPUOffloadPolicy``, optimizer step on the CPU; not in
the default list: untried on a GPU, and ``clip_grad_norm_`` on CPU-offloaded DTensors failed in
pytorch/pytorch#148532). Each setting builds a fresh model, shards it with
``posttrain.distributed.fsdp.shard_model`` and runs ``--steps`` steps (the first is warm-up; the
last is reported):

1. ``gen``: ``HFRolloutEngine`` sampling (``n`` responses per prompt) inside
   ``gathered_for_generation`` (parameters all-gathered once, no collectives while decoding);
2. ``old_log_prob``: ``ActorWorker.compute_log_prob``;
3. GRPO advantages from random rewards (group-normalised per prompt);
4. ``update``: ``ActorWorker.update_policy`` (one mini-batch, micro-batches of ``--micro``).

Reported per phase: seconds, tokens/s, model FLOP/s and its fraction of ``--peak-tflops`` (default
790, the figure this project uses for an H200's dense bf16 rate), CUDA peak memory allocated in the
phase and memory still allocated after it. Model FLOPs (padding not counted, recomputation of
gradient checkpointing not counted, as for MFU): ``2 x`` matmul parameters per token per forward
(decoder layers on every token; ``lm_head`` only where logits are taken: generated tokens and
scored response tokens), plus attention scores ``4 x layers x hidden x context`` per token;
``3 x`` a forward for forward + backward.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/helpers: tiny configs

from posttrain.batch import Batch  # noqa: E402
from posttrain.config.actor_rollout_ref import FSDPConfig, MixedPrecisionConfig  # noqa: E402
from posttrain.distributed.fsdp import (  # noqa: E402
    backend_for,
    build_mesh,
    gathered_for_generation,
    init_distributed,
    offload_model_to_cpu,
    offload_optimizer,
    resident_for_phase,
    shard_model,
)
from posttrain.rollout import SamplingParams  # noqa: E402
from posttrain.workers import ActorWorker  # noqa: E402
from helpers.tiny_models import tiny_worker_configs  # noqa: E402

SETTINGS = {
    "base": dict(param_offload=False, optimizer_offload=False, offload_policy=False, ckpt=False),
    "ckpt": dict(param_offload=False, optimizer_offload=False, offload_policy=False, ckpt=True),
    "offload": dict(param_offload=True, optimizer_offload=True, offload_policy=False, ckpt=False),
    "offload_ckpt": dict(param_offload=True, optimizer_offload=True, offload_policy=False, ckpt=True),
    "offload_policy": dict(param_offload=False, optimizer_offload=False, offload_policy=True, ckpt=False),
}
QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=256, tie_word_embeddings=True)
PAD, EOS = 0, 1


@dataclass
class Work:
    """Shapes of one step: ``prompts`` x ``n`` rows of ``prompt_len`` + up to ``response_len`` tokens."""

    prompts: int
    n: int
    prompt_len: int
    response_len: int
    micro: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, few tokens, fp32, gloo")
    p.add_argument("--settings", default="base,ckpt,offload,offload_ckpt", help=f"comma list of {list(SETTINGS)}")
    p.add_argument("--steps", type=int, default=2, help="steps per setting; the last is reported")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="responses per prompt")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--micro", type=int, default=16, help="rows per micro-batch (log-prob and update)")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak of the GPU, for the fraction")
    p.add_argument("--json", type=Path, help="also write the summary here")
    args = p.parse_args(argv)
    if args.tiny:
        args.prompts, args.n, args.prompt_len, args.response_len, args.micro = 2, 2, 8, 6, 2
        args.steps = min(args.steps, 2)
    return args


# --------------------------------------------------------------------------- set-up
def start_process_group(device: str) -> None:
    """World size 1 through the same ``init_distributed`` the ranks use (NCCL on CUDA, gloo on CPU)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    init_distributed(backend_for(device))


def build_model(device: str, tiny: bool) -> torch.nn.Module:
    """Random-initialised Qwen2 (fp32 master weights), built directly on ``device``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**(TINY if tiny else QWEN2_05B), pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM(config)


def random_prompts(work: Work, vocab: int) -> Batch:
    """``[prompts, prompt_len]`` token ids from ``[2, vocab)`` (no pad, no EOS), all positions valid."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, vocab, (work.prompts, work.prompt_len), generator=g)
    mask = torch.ones_like(ids)
    return Batch.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(work.prompt_len)
                            .expand_as(ids).clone()})


def fsdp_config(setting: dict, param_dtype: str) -> FSDPConfig:
    return FSDPConfig(param_offload=setting["param_offload"], optimizer_offload=setting["optimizer_offload"],
                      offload_policy=setting["offload_policy"], model_dtype="fp32",
                      mixed_precision=MixedPrecisionConfig(param_dtype=param_dtype))


def build_actor(setting: dict, work: Work, device: str, mesh: Any, tiny: bool) -> ActorWorker:
    """Sharded model + ActorWorker, left in the between-phases state (offloaded when asked)."""
    param_dtype = "fp32" if device == "cpu" else "bf16"
    fsdp = fsdp_config(setting, param_dtype)
    model = shard_model(build_model(device, tiny), mesh, fsdp, gradient_checkpointing=setting["ckpt"])
    rows = work.prompts * work.n
    cfg = tiny_worker_configs(response_length=work.response_len, mini_batch_size=rows, micro_batch_size=work.micro,
                              param_dtype=param_dtype, temperature=1.0, n=work.n, lr=1e-6,
                              actor={"fsdp_config": fsdp, "grad_clip": 1.0})
    tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
    actor = ActorWorker(None, cfg.actor, cfg.rollout, device=device, module=model, tokenizer=tokenizer)
    if setting["param_offload"]:
        offload_model_to_cpu(model)
    if setting["optimizer_offload"]:
        offload_optimizer(actor.optimizer)
    return actor


# --------------------------------------------------------------------------- measuring
@contextmanager
def phase(record: dict, name: str, device: str) -> Iterator[dict]:
    """Wall seconds, peak memory allocated during the phase and memory left allocated after it (GiB)."""
    stats: dict[str, Any] = {}
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    yield stats
    if cuda:
        torch.cuda.synchronize()
    stats["seconds"] = time.perf_counter() - start
    stats["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    stats["after_gib"] = torch.cuda.memory_allocated() / 2**30 if cuda else None
    record[name] = stats


def matmul_params(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """(decoder-layer parameters, lm_head ``V x H``, layers, hidden): what FLOPs are counted on."""
    cfg = model.config
    layers = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
    return layers, cfg.vocab_size * cfg.hidden_size, cfg.num_hidden_layers, cfg.hidden_size


def forward_flops(dims: tuple[int, int, int, int], tokens: float, head_tokens: float, context_sum: float) -> float:
    """``2 * layer_params * tokens + 2 * V*H * head_tokens + 4 * L * H * context_sum`` (see module docstring)."""
    body, head, n_layers, hidden = dims
    return 2 * body * tokens + 2 * head * head_tokens + 4 * n_layers * hidden * context_sum


def grpo_advantages(rows: int, n: int, response_mask: torch.Tensor) -> torch.Tensor:
    """Random 0/1 rewards, normalised within each prompt's ``n`` responses, broadcast over tokens."""
    rewards = torch.randint(0, 2, (rows,), generator=torch.Generator().manual_seed(2)).float().view(-1, n)
    adv = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-6)
    return adv.view(-1, 1) * response_mask


def grpo_step(actor: ActorWorker, prompts: Batch, work: Work, device: str) -> dict:
    """gen -> old log-prob -> update, each phase with its parameters (and optimizer) resident."""
    record: dict[str, Any] = {}
    model = actor.module
    sampling = SamplingParams(n=work.n, temperature=1.0, response_length=work.response_len, calculate_log_probs=False)
    with phase(record, "gen", device):
        with resident_for_phase(model), torch.no_grad(), gathered_for_generation(model):
            batch = actor.rollout.generate(prompts, sampling)
    batch.meta_info["temperature"] = 1.0
    with phase(record, "old_log_prob", device):
        with resident_for_phase(model):
            batch.batch["old_log_probs"], _ = actor.compute_log_prob(batch, calculate_entropy=False)
    batch.batch["advantages"] = grpo_advantages(len(batch), work.n, batch["response_mask"])
    with phase(record, "update", device) as stats:
        with resident_for_phase(model, actor.optimizer):
            metrics = actor.update_policy(batch)
        stats["grad_norm"], stats["pg_loss"] = metrics["actor/grad_norm"], metrics["actor/pg_loss"]
    add_rates(record, batch, matmul_params(model), work)
    return record


def add_rates(record: dict, batch: Batch, dims: tuple, work: Work) -> None:
    """tokens/s and model FLOP/s of each phase from the batch's valid tokens."""
    resp = float(batch["response_mask"].sum())
    lengths = batch["attention_mask"].sum(-1).float()
    all_tokens = float(lengths.sum())
    causal_context = float((lengths * (lengths + 1) / 2).sum())  # sum over tokens of the positions attended
    prefill = float(work.prompts * work.prompt_len)  # each distinct prompt is prefilled once
    gen_context = float((batch["response_mask"].cumsum(-1) + work.prompt_len).mul(batch["response_mask"]).sum())
    flops = {
        "gen": forward_flops(dims, prefill + resp, resp, gen_context + prefill * (work.prompt_len + 1) / 2),
        "old_log_prob": forward_flops(dims, all_tokens, resp, causal_context),
        "update": 3 * forward_flops(dims, all_tokens, resp, causal_context),
    }
    tokens = {"gen": resp, "old_log_prob": all_tokens, "update": all_tokens}
    for name, f in flops.items():
        secs = record[name]["seconds"]
        record[name].update(tokens=tokens[name], tokens_per_s=tokens[name] / secs, tflops=f / secs / 1e12)
    record["step_seconds"] = sum(record[n]["seconds"] for n in flops)
    record["step_tokens_per_s"] = all_tokens / record["step_seconds"]


def run_setting(name: str, args: argparse.Namespace, device: str, mesh: Any) -> dict:
    work = Work(args.prompts, args.n, args.prompt_len, args.response_len, args.micro)
    setting = SETTINGS[name]
    actor = build_actor(setting, work, device, mesh, args.tiny)
    prompts = random_prompts(work, actor.module.config.vocab_size)
    resident = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else None
    steps = [grpo_step(actor, prompts, work, device) for _ in range(args.steps)]
    result = {"setting": name, **setting, "resident_between_phases_gib": resident, "last_step": steps[-1],
              "step_seconds_all": [s["step_seconds"] for s in steps]}
    for ph in ("gen", "old_log_prob", "update"):
        result["last_step"][ph]["fraction_of_peak"] = result["last_step"][ph]["tflops"] / args.peak_tflops
    del actor, steps
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def table_row(result: dict) -> dict:
    """One line per setting: the figures to compare between memory settings."""
    last = result["last_step"]
    peaks = [last[ph]["peak_gib"] for ph in ("gen", "old_log_prob", "update")]
    return {"setting": result["setting"], "step_s": round(last["step_seconds"], 3),
            "gen_tokens_per_s": round(last["gen"]["tokens_per_s"], 1),
            "update_tflops": round(last["update"]["tflops"], 3),
            "update_fraction_of_peak": round(last["update"]["fraction_of_peak"], 4),
            "peak_gib": None if peaks[0] is None else round(max(peaks), 3),
            "resident_between_phases_gib": result["resident_between_phases_gib"]}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.tiny:
        raise SystemExit("no CUDA device: run with --tiny for the CPU smoke test")
    if device == "cpu":
        torch.set_num_threads(min(torch.get_num_threads(), 2))
    start_process_group(device)
    mesh = build_mesh(device, 1)
    summary = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
               "params": sum(p.numel() for p in build_model("meta", args.tiny).parameters()),
               "work": vars(Work(args.prompts, args.n, args.prompt_len, args.response_len, args.micro)),
               "peak_tflops": args.peak_tflops,
               "settings": [run_setting(name, args, device, mesh) for name in args.settings.split(",")]}
    summary["table"] = [table_row(r) for r in summary["settings"]]
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    torch.distributed.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
