"""Milliseconds per decoding step of a SmolLM2-135M-shaped model, by rows decoded together and precision.

    python benchmarks/bench_decode.py                 # 1, 32 and 128 rows
    python benchmarks/bench_decode.py --rows 32

Random weights (no download), a KV cache of 80 prompt tokens, greedy, 16 steps timed after a
warm-up. Three ways to run the same model: fp32 weights under bf16 autocast (what the `hf` engine
does when `param_dtype` is bf16), fp32 throughout, and weights cast to bf16 once (no autocast).
Each step multiplies every weight once per row (2 x params x rows FLOP), so the step time against
that work shows whether decoding is bound by the matmuls or by streaming the weights and per-op
overhead. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import time

from posttrain.host.threads import choose_wait_policy  # noqa: E402  (imports no torch)

choose_wait_policy()  # as the posttrain CLI, before torch loads (posttrain/host/threads.py)

import torch  # noqa: E402


def smollm2_shaped(dtype: torch.dtype = torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval().to(dtype)


@torch.no_grad()
def ms_per_step(model, rows: int, autocast: bool, steps: int = 16) -> float:
    ids = torch.randint(0, model.config.vocab_size, (rows, 80))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        for i in range(steps + 2):  # two warm-up steps
            if i == 2:
                start = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return 1e3 * (time.perf_counter() - start) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128])
    args = ap.parse_args()
    fp32 = smollm2_shaped()
    bf16 = smollm2_shaped(torch.bfloat16)
    params = sum(p.numel() for p in fp32.parameters())
    print(f"load average {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}; {params / 1e6:.1f}M params")
    print(f"{'rows':>5} {'autocast bf16':>14} {'fp32':>8} {'bf16 weights':>13} {'GFLOP/step':>11}")
    for rows in args.rows:
        a, f, b = ms_per_step(fp32, rows, True), ms_per_step(fp32, rows, False), ms_per_step(bf16, rows, False)
        print(f"{rows:>5} {a:>11.1f} ms {f:>5.1f} ms {b:>10.1f} ms {2 * params * rows / 1e9:>11.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
