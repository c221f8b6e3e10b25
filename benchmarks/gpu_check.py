"""One-GPU check of posttrain's FSDP2 path: a GRPO-like step on a random ~0.5B Qwen2, per memory setting.

    python benchmarks/gpu_check.py                          # CUDA: FSDP2 world size 1 (NCCL), bf16
    python benchmarks/gpu_check.py --json gpu_check.json    # also write the summary to a file
    python benchmarks/gpu_check.py --tiny                   # CPU smoke test (gloo, fp32, tiny model)
    python benchmarks/gpu_check.py --checks weight_sync     # only the trainer -> rollout weight sync
    python benchmarks/gpu_check.py --checks lean            # only the lean backward paths against autograd

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

``weight_sync`` (issue 39, `posttrain.distributed.weight_sync`): a trainer process pushes the same
random model to a rollout process that built it with other values, through a ``WeightSyncGroup``:
NCCL from ``cuda:0`` to ``cuda:1`` when two GPUs are visible; with one GPU, gloo with both models on
it (NCCL refuses two ranks on one device, "Duplicate GPU detected"), and ``nccl`` is reported as
skipped; ``--tiny``: gloo on CPU. Cases ``fp32`` (every weight) and ``bf16`` (cast on the trainer,
what a bf16 engine takes): median seconds of ``--sync-reps`` pushes until the receiver has loaded,
bytes, GB/s, and ``bit_equal`` (a float64 digest of every weight as sent, compared across processes).

``lean`` (issue 41's autograd functions, written for the CPU and run on CUDA here): one process, no FSDP,
float32 weights under bf16 autocast (the one-process placement's mixed precision on a GPU), one micro-batch's
forward + backward through ``response_logprobs`` (log-prob and entropy terms) on the same weights:
``autograd`` (a no-op hook on ``lm_head``, so the head goes through autograd chunk by chunk, and the layers as
transformers builds them), ``lean`` (`keep_less_for_backward` on the layers, the head as one
`_LinearHeadLogProbs` node summing the weight's gradient into ``.grad`` as the update's micro-step does) and
the reference, the model in float64 without autocast; each runs two micro-batches per repetition (the
second, with ``.grad`` already there as in gradient accumulation, is the one measured). The two bf16 paths round
differently, so each is compared with float64: per gradient tensor the relative error (norm of the difference
over the reference's norm), and the ratio of lean's error to autograd's (the CPU test's bound is 1.2x).
Also, of each, the CUDA peak above the weights and the median seconds of ``--lean-reps`` passes after a warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from contextlib import contextmanager, nullcontext
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
from posttrain.distributed.weight_sync import (  # noqa: E402
    WeightSyncGroup,
    push_trainer_weights,
    receive_into,
    trainer_weights,
)
from posttrain.models.lean.backward import keep_less_for_backward  # noqa: E402
from posttrain.models.lean.into_grad import embeddings_add_into_grad, grads_into_params  # noqa: E402
from posttrain.models.logprobs import response_logprobs  # noqa: E402
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
    p.add_argument("--checks", default="fsdp,weight_sync,lean", help="comma list of fsdp, weight_sync, lean")
    p.add_argument("--lean-reps", type=int, default=3, help="timed forward + backward passes per lean variant")
    p.add_argument("--sync-reps", type=int, default=3, help="timed weight pushes per case (after one warm-up)")
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
    # param_dtype given: the sharded model is taken as placed (OnDevice would move it, offloaded parameters too)
    actor = ActorWorker(None, cfg.actor, cfg.rollout, device=device, module=model, tokenizer=tokenizer,
                        param_dtype=param_dtype)
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
    print(json.dumps({**table_row(result), "step_seconds_all": result["step_seconds_all"]}), flush=True)  # kept if a later setting fails
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
    checks = args.checks.split(",")
    summary = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
               "params": sum(p.numel() for p in build_model("meta", args.tiny).parameters())}
    if "weight_sync" in checks:  # first: its processes are spawned before this one holds a process group
        summary["weight_sync"] = weight_sync_check(args)
    if "lean" in checks:
        summary["lean"] = lean_check(args, device)
        print(json.dumps({"lean": summary["lean"]}), flush=True)
    if "fsdp" in checks:
        start_process_group(device)
        mesh = build_mesh(device, 1)
        summary.update({"work": vars(Work(args.prompts, args.n, args.prompt_len, args.response_len, args.micro)),
                        "peak_tflops": args.peak_tflops,
                        "settings": [run_setting(name, args, device, mesh) for name in args.settings.split(",")]})
        summary["table"] = [table_row(r) for r in summary["settings"]]
        torch.distributed.destroy_process_group()
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return summary


# --------------------------------------------------------------------------- weight sync (issue 39)
def weight_sync_plan(tiny: bool) -> dict:
    """Backend and devices of the two processes (module docstring, ``weight_sync``)."""
    gpus = 0 if tiny else torch.cuda.device_count()
    if gpus >= 2:
        return {"backend": "nccl", "devices": ["cuda:0", "cuda:1"], "nccl": "ran"}
    if gpus == 1:
        return {"backend": "gloo", "devices": ["cuda:0", "cuda:0"],
                "nccl": "skipped: one GPU (NCCL refuses two ranks on one device); gloo with both models on it"}
    return {"backend": "gloo", "devices": ["cpu", "cpu"], "nccl": "skipped: --tiny (CPU)"}


def sync_digest(model: torch.nn.Module, dtype: torch.dtype | None) -> dict[str, list[float]]:
    """float64 sum and sum of squares of every weight as sent (identical on both sides when all arrived)."""
    out = {}
    for name, t in trainer_weights(model, dtype=dtype):
        t = t.to(torch.float64)
        out[name] = [float(t.sum()), float((t * t).sum())]
    return out


def weight_sync_rank(rank: int, port: int, plan: dict, args: argparse.Namespace, out_dir: str) -> None:
    """Rank 0 pushes its model ``--sync-reps`` + 1 times per case; rank 1 (other values) loads it."""
    device = plan["devices"][rank]
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    torch.set_num_threads(1)
    model = build_model(device, args.tiny)
    if rank == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # other values everywhere: a tensor that does not arrive breaks bit_equal
    group = WeightSyncGroup.create("127.0.0.1", port, rank, 2, plan["backend"], timeout_s=300,
                                   device=device if plan["backend"] == "nccl" else None)
    results, version = {}, 0
    for case, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        seconds = []
        for _ in range(args.sync_reps + 1):
            version += 1
            if rank == 0:
                seconds.append(push_trainer_weights(group, model, version, dtype=dtype)["weight_sync/seconds"])
            else:
                receive_into(group, model)
        sent = sum(t.numel() * t.element_size() for _, t in trainer_weights(model, dtype=dtype))
        results[case] = {"seconds": seconds[1:], "bytes": sent, "digest": sync_digest(model, dtype)}
    group.close()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def weight_sync_check(args: argparse.Namespace) -> dict:
    """Two spawned processes (CUDA cannot be forked); their figures and whether every weight arrived."""
    import socket
    import statistics
    import tempfile

    import torch.multiprocessing as torch_mp

    plan = weight_sync_plan(args.tiny)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="gpu-check-sync-") as out:
        torch_mp.start_processes(weight_sync_rank, nprocs=2, join=True, start_method="spawn",
                                 args=(port, plan, args, out))
        trainer, rollout = (torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in (0, 1))
    cases = {}
    for case, result in trainer.items():
        median = statistics.median(result["seconds"])
        cases[case] = {"median_s": round(median, 4), "seconds": [round(x, 4) for x in result["seconds"]],
                       "bytes": result["bytes"], "GB_per_s": round(result["bytes"] / median / 1e9, 3),
                       "bit_equal": result["digest"] == rollout[case]["digest"]}
    return {**plan, "cases": cases}


# --------------------------------------------------------------------------- lean backward (issue 41)
def lean_micro_batch(work: Work, vocab: int, device: str) -> dict[str, torch.Tensor]:
    """``--micro`` rows of random prompt + response ids, every position valid."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, vocab, (work.micro, work.prompt_len + work.response_len), generator=g).to(device)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids).contiguous()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": positions,
            "responses": ids[:, work.prompt_len:]}


def lean_variant(kind: str, args: argparse.Namespace, device: str, work: Work) -> dict:
    """Log-probs, gradients, peak above the weights and seconds of one variant (``lean_check``): ``autograd``,
    ``lean`` (both float32 weights under bf16 autocast) or ``float64`` (the reference: no autocast)."""
    model = build_model(device, args.tiny)  # same seed: the same weights for every variant
    if kind == "lean":
        keep_less_for_backward(model)
        embeddings_add_into_grad(model)
    elif kind == "autograd":
        model.lm_head.register_forward_pre_hook(lambda module, inputs: None)  # a hooked head: autograd's path
    else:
        model.double()
    batch = lean_micro_batch(work, model.config.vocab_size, device)
    into_param = grads_into_params if kind == "lean" else nullcontext  # as the update's micro-step
    seconds, peaks = [], []
    for _ in range(args.lean_reps + 1 if kind != "float64" else 1):
        model.zero_grad(set_to_none=True)
        for _micro_batch in range(2):  # two micro-batches: the second is timed, with .grad already there
            with phase({}, "pass", device) as stats:
                before = torch.cuda.memory_allocated() if device == "cuda" else 0
                with into_param(), torch.autocast(device, dtype=torch.bfloat16, enabled=kind != "float64"):
                    log_probs, entropy = response_logprobs(model, **batch, calculate_entropy=True)
                (-(log_probs.mean()) - 0.01 * entropy.mean()).backward()
        seconds.append(stats["seconds"])
        peaks.append(stats["peak_gib"] - before / 2**30 if device == "cuda" else None)
    for p in model.parameters():
        p.grad.div_(2)  # the two identical micro-batches' sum: exactly twice each term
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    timed = sorted(seconds[1:]) or seconds
    return {"log_probs": log_probs.detach(), "grads": grads, "peak_gib": peaks[-1], "median_s": timed[len(timed) // 2]}


def relative_error(grad: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.double()
    return float((grad.double() - reference).norm() / reference.norm().clamp_min(1e-300))


def lean_check(args: argparse.Namespace, device: str) -> dict:
    """The lean paths against autograd on the same micro-batch, both against float64 (module docstring, ``lean``)."""
    work = Work(args.prompts, args.n, args.prompt_len, args.response_len, args.micro)
    exact = lean_variant("float64", args, device, work)
    out: dict[str, Any] = {"tokens": work.micro * (work.prompt_len + work.response_len)}
    errors = {}
    for kind in ("autograd", "lean"):
        result = lean_variant(kind, args, device, work)
        errors[kind] = {n: relative_error(g, exact["grads"][n]) for n, g in result["grads"].items()}
        out[kind] = {"peak_gib": result["peak_gib"], "median_s": result["median_s"],
                     "log_probs_max_abs_error": float((result["log_probs"].double() - exact["log_probs"]).abs().max()),
                     "grad_error_median": sorted(errors[kind].values())[len(errors[kind]) // 2],
                     "grad_error_max": max(errors[kind].values())}
    # per tensor, the lean error over autograd's: <= 1 where lean is as close to float64 as autograd
    ratios = {n: errors["lean"][n] / max(e, 1e-12) for n, e in errors["autograd"].items()}
    worst = max(ratios, key=ratios.get)
    out.update(worst_error_ratio=ratios[worst], worst_error_ratio_tensor=worst,
               tensors_within_1_2x=sum(r <= 1.2 for r in ratios.values()), tensors=len(ratios))
    return out


if __name__ == "__main__":
    main()
