"""How OpenMP's wait policy behaves on a quiet and on a shared 2-core machine.

    python benchmarks/bench_threads.py            # each wait setting, quiet and beside 1 busy process

The work is what a training step does, on a model shaped like SmolLM2-135M (random weights, no
download): 16 greedy decode steps for 32 rows with a KV cache (many small ops, each ending in a
thread barrier) and one forward + backward over 32 x 64 tokens. Each setting runs in a fresh
process (the policy is read when OpenMP starts) with torch's default thread count; the competing
job is a pure-Python busy loop, like another user's process on the same cores.
Prints seconds per setting and the slowdown that the competing process causes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def work(dtype: str) -> dict[str, float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (32, 64))
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    out = {}
    with torch.no_grad(), cast:
        model.generate(ids[:, :48], max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        model.generate(ids[:, :48], max_new_tokens=16, min_new_tokens=16, do_sample=False)
        out["decode_s"] = time.perf_counter() - start
    model.train()
    start = time.perf_counter()
    with cast:
        loss = model(ids, labels=ids).loss
    loss.backward()
    out["fwd_bwd_s"] = time.perf_counter() - start
    out["threads"] = torch.get_num_threads()
    return out


# name -> environment: libgomp's default (spin ~300k iterations, then sleep), spin forever, never
# spin, and a short spin. These variables are read once, when the OpenMP runtime starts.
SETTINGS = {
    "default": {},
    "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
    "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
}


def run_setting(name: str, busy: bool, dtype: str) -> dict[str, float]:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env.update(SETTINGS[name])
        res = subprocess.run([sys.executable, __file__, "--worker", "--dtype", dtype], env=env, check=True,
                             capture_output=True, text=True)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(work(args.dtype)))
        return 0
    print(f"load average at start: {os.getloadavg()[0]:.2f}; cpus: {os.cpu_count()}; dtype {args.dtype}")
    rows = {}
    for name in SETTINGS:
        for busy in (False, True):
            r = run_setting(name, busy, args.dtype)
            rows[(name, busy)] = r
            print(f"{name:<21} {'1 busy process' if busy else 'quiet':<15} "
                  f"decode {r['decode_s']:6.2f} s  fwd+bwd {r['fwd_bwd_s']:6.2f} s  ({r['threads']} threads)", flush=True)
    total = {k: r["decode_s"] + r["fwd_bwd_s"] for k, r in rows.items()}
    base = total[("default", False)]
    for name in SETTINGS:
        print(f"{name:<21} quiet {total[(name, False)] / base:.2f}x of the default's quiet time; beside a busy "
              f"process {total[(name, True)] / base:.2f}x (its own busy/quiet {total[(name, True)] / total[(name, False)]:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
