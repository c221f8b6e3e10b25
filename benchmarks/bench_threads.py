"""How OpenMP's wait policy behaves on a quiet and on a shared 2-core machine.

    python benchmarks/bench_threads.py            # ACTIVE vs PASSIVE, quiet and beside 1 busy process

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


def run_setting(policy: str, busy: bool, dtype: str) -> dict[str, float]:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        env = {**os.environ, "OMP_WAIT_POLICY": policy}
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
    for policy in ("ACTIVE", "PASSIVE"):
        for busy in (False, True):
            r = run_setting(policy, busy, args.dtype)
            rows[(policy, busy)] = r
            print(f"OMP_WAIT_POLICY={policy:<8} {'1 busy process' if busy else 'quiet':<15} "
                  f"decode {r['decode_s']:6.2f} s  fwd+bwd {r['fwd_bwd_s']:6.2f} s  ({r['threads']} threads)", flush=True)
    for policy in ("ACTIVE", "PASSIVE"):
        q, b = rows[(policy, False)], rows[(policy, True)]
        total_q, total_b = q["decode_s"] + q["fwd_bwd_s"], b["decode_s"] + b["fwd_bwd_s"]
        print(f"{policy}: busy/quiet = {total_b / total_q:.2f}x (decode {b['decode_s'] / q['decode_s']:.2f}x, "
              f"fwd+bwd {b['fwd_bwd_s'] / q['fwd_bwd_s']:.2f}x)")
    qa, qp = rows[("ACTIVE", False)], rows[("PASSIVE", False)]
    print(f"quiet: PASSIVE/ACTIVE = {(qp['decode_s'] + qp['fwd_bwd_s']) / (qa['decode_s'] + qa['fwd_bwd_s']):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
