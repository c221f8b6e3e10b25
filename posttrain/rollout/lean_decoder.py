"""One-token decoding steps of Llama-family models in a few large ops, for the ``hf`` engine on CPU.

A decoding step of SmolLM2-135M at 20 rows spends about a third of its time outside the matmuls:
``transformers``' forward makes ~60 small ops and as many Python calls per layer (mask building,
cache bookkeeping, separate q/k/v and gate/up projections), each a few microseconds on a CPU.
Here a step of the same model is ~15 ops per layer: q/k/v as one matmul and gate/up as one (their
weights concatenated, or packed together, once per generation), rotary embedding from the model's own rotary module,
keys and values written in place into preallocated buffers, grouped-query attention of the one
query against them (float32 softmax), SiLU-gated MLP. A prompt's keys and values are kept once for
all of its samples (GRPO's ``n``): at GSM8K length the prompts are half the cache a step reads. A
beginning every prompt shares (a system prompt, a worked example, which the engine prefills once)
is kept once for all of them. Under bf16 autocast the weights are cast to bf16 once per generation
(and packed for oneDNN where the CPU multiplies bf16 natively) and the ops keep autocast's precisions
(bf16 matmuls, float32 norms and residual stream).

fp32 weights are packed once per generation into the layout a GEMM kernel wants, because for a few
rows a plain fp32 GEMM spends much of each call re-packing the whole weight into its panels. Two
packings exist in x86 builds of torch, and which is faster depends on the CPU, so the first decoder
of a machine times both on its first layer's weights (:func:`fp32_matmul_backend`, once, cached):

- oneDNN's blocked layout (``_reorder_linear_weight``): one packing serves every row count. On an
  AVX2 CPU without AVX-512 it beat both MKL's packing and the plain GEMM by far.
- MKL's packed GEMM (``cblas_sgemm_pack``): packed for one row count, then panels only; on an AMX
  CPU it was on a par with oneDNN, and faster than the plain GEMM at 20 rows. Packing all
  weights costs what the packed product saves in many steps, so when rows leave the batch the
  packed weights are kept, and the rows padded to the packed count, until fewer than half remain;
  they are packed again only where the steps left can repay it, and never for fewer than 4 rows,
  where the plain GEMM reads each weight once.

Either gives the plain product up to fp32 rounding (a different order of the same sums).

Prefill stays ``transformers``' own forward (long inputs, its masks), once per distinct prompt; its
KV cache is then moved into this decoder, beside buffers for the generated tokens of every sample. :func:`lean_decoder_for` returns None, and the engine keeps the
model's forward, for anything this does not reproduce exactly or was not built for: a model on a
GPU, other architectures, sliding-window attention, LoRA-wrapped or otherwise non-``nn.Linear``
projections, non-SiLU MLPs, sharded (DTensor) weights, caches without per-layer keys/values. ``tests/rollout/test_lean_decoder.py``
checks the logits against the model's forward step by step.

In the trainer it is faster than the engine's plain step (with posttrain's CPU attention) at
GSM8K length, or within the noise, and even with it at the built-in run's <= 32 tokens; against
transformers' own decoding step it is clearly faster. Measured with ``benchmarks/bench_ab.py --lever
lean`` and by hand (the kernels' timings): figures and machines in benchmarks/README.md, "Lean decoder".
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from transformers.models.llama.modeling_llama import rotate_half  # mistral's and qwen2's are the same

from posttrain.host.allocator import mapped_allocations
from posttrain.host.cache import cache_root, machine_key, read_answers, write_answer
from posttrain.models.attention import single_query_probs
from posttrain.models.lean.backward import RecastLinear

__all__ = [
    "LEAN_MODEL_TYPES", "LeanDecoder", "fp32_matmul_backend", "lean_decoder_for", "mkl_packing_available",
    "onednn_bf16_packing_available", "onednn_fp32_packing_available",
]

LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2")
"""``config.model_type`` values whose decoder layer this module reproduces (RMSNorm, rotary q/k,
grouped-query attention with optional q/k/v bias, SiLU-gated MLP)."""


PACK_MIN_ROWS = 4
"""Fewer rows multiply the model's weights directly: MKL's plain fp32 GEMM reads the weights once
at 1-3 rows, as fast as a packed product, so packing never pays; from 4 rows on it re-packs every
call and the packed product is faster (benchmarks/README.md, "Lean decoder")."""

REPACK_MIN_STEPS = 16
"""Pack the weights for a new row count only when at least this many decoding steps may remain:
a packing costs what the packed product saves over the plain GEMM in many steps at 4-12 rows
(benchmarks/README.md, "Lean decoder")."""


def mkl_packing_available() -> bool:
    """True where this torch build has MKL's packed fp32 GEMM (x86 builds; not ARM)."""
    return bool(getattr(torch._C, "has_mkl", False)) and hasattr(torch.ops.mkl, "_mkl_linear")


def onednn_fp32_packing_available() -> bool:
    """True where this torch build can pack fp32 weights for oneDNN (x86 builds with mkldnn)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


MEASURE_ROWS = 16
"""Rows at which :func:`fp32_matmul_backend` times the packings (the built-in run decodes 32 rows
that leave as they end; GSM8K-shaped steps 20)."""

_FP32_BACKENDS: dict[tuple, str] = {}


def fp32_matmul_backend(groups: list[list[nn.Linear]]) -> str:
    """``"onednn"``, ``"mkl"`` or ``"plain"``: the fastest fp32 product for these projections (a
    layer's, each group fused into one weight as the step multiplies them) at :data:`MEASURE_ROWS`
    rows, timed once per machine for their shapes and thread count (each available packing and the
    plain GEMM, 5 alternating rounds, best of each; oneDNN's single packing wins ties within 5%,
    since it needs no re-packing as rows leave) and cached in ``fp32_matmul.json`` in posttrain's
    cache: the kernels round differently, so a run that timed them anew could pick another and
    sample differently from a run with the same seed. Later calls only look the answer up."""
    shapes = tuple((sum(lin.out_features for lin in group), group[0].in_features) for group in groups)
    key = (shapes, torch.get_num_threads())
    if key not in _FP32_BACKENDS:
        path = cache_root() / "fp32_matmul.json"
        machine = machine_key(torch.__version__, str(torch.get_num_threads()), json.dumps(shapes))
        cached = read_answers(path).get(machine)
        if cached not in _available_fp32_backends():
            cached = _time_fp32_backends([torch.cat([lin.weight.detach() for lin in group]) for group in groups])
            write_answer(path, machine, cached)
        _FP32_BACKENDS[key] = cached
    return _FP32_BACKENDS[key]


def _available_fp32_backends() -> set[str]:
    return {"plain"} | ({"onednn"} if onednn_fp32_packing_available() else set()) | (
        {"mkl"} if mkl_packing_available() else set())


def _time_fp32_backends(weights: list[torch.Tensor]) -> str:
    generator = torch.Generator().manual_seed(0)  # not the global RNG: that one draws the samples
    inputs = [torch.randn(MEASURE_ROWS, w.shape[1], generator=generator) for w in weights]
    products: dict[str, Any] = {"plain": [functools.partial(F.linear, weight=w) for w in weights]}
    with mapped_allocations():
        if onednn_fp32_packing_available():
            try:
                packs = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
                products["onednn"] = [functools.partial(_onednn_linear, weight=p, bias=None) for p in packs]
            except RuntimeError:  # a build whose oneDNN cannot pack fp32 weights
                pass
        if mkl_packing_available():
            packs = [torch.ops.mkl._mkl_reorder_linear_weight(w, MEASURE_ROWS) for w in weights]
            products["mkl"] = [functools.partial(torch.ops.mkl._mkl_linear, MKL_W=p, ORI_W=w, B=None,
                                                  batch_size=MEASURE_ROWS) for p, w in zip(packs, weights)]
        best = {name: float("inf") for name in products}
        for _ in range(5):
            for name, calls in products.items():
                start = time.perf_counter()
                for call, x in zip(calls, inputs):
                    call(x)
                best[name] = min(best[name], time.perf_counter() - start)
    return _fastest_fp32_backend(best)


def _fastest_fp32_backend(seconds: dict[str, float]) -> str:
    if "onednn" in seconds and seconds["onednn"] <= 1.05 * min(seconds.values()):
        return "onednn"  # within 5% of the best: its one packing serves every row count
    return min(seconds, key=seconds.get)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache  # the build and the CPU do not change within a process
def onednn_bf16_packing_available() -> bool:
    """True where oneDNN can pack bf16 weights and this CPU multiplies bf16 natively (AVX512-BF16, AMX)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class _Weight:
    """One projection, or several fused into one matmul (q/k/v, gate/up), in the step's precision.

    fp32, ``backend="onednn"``: packed once into oneDNN's blocked layout, every row count.
    fp32, ``backend="mkl"``: packed for the batch's row count straight from the model's own weights
    (no fused copy is kept: packing is the copy), padded to the packed count while at least half the
    rows remain, then packed again for the new count if enough steps may remain to repay it
    (:data:`REPACK_MIN_STEPS`); otherwise, and below :data:`PACK_MIN_ROWS` rows, the model's own
    weights are multiplied directly.
    bf16 with oneDNN: the fused bf16 copy packed once into oneDNN's blocked layout, which serves every
    row count and is faster than ``F.linear`` at 1 and at 32 rows on an AMX CPU (bit-equal to it;
    benchmarks/README.md, "Lean decoder").
    Otherwise (float64, no MKL or oneDNN): one fused copy in ``dtype``.
    """

    __slots__ = ("linears", "bias", "weight", "onednn", "packed", "rows", "shape")

    def __init__(self, linears: list[nn.Linear], dtype: torch.dtype, backend: str = "mkl"):
        self.linears = linears
        biases = [lin.bias for lin in linears]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else lin.weight.new_zeros(lin.out_features) for b, lin in zip(biases, linears)]
        ).to(dtype)
        fp32 = dtype == torch.float32 and all(lin.weight.dtype == torch.float32 for lin in linears)
        packable = fp32 and backend == "mkl" and mkl_packing_available()
        self.weight = None if packable else self._source().to(dtype)
        self.onednn = None
        if (dtype == torch.bfloat16 and onednn_bf16_packing_available()) or (fp32 and backend == "onednn"):
            try:
                self.onednn, self.weight = torch.ops.mkldnn._reorder_linear_weight(self.weight), None
            except RuntimeError:  # a build whose oneDNN cannot pack this weight (e.g. some ARM builds): plain copy
                self.onednn = None
        self.packed, self.rows = None, 0
        # _mkl_linear reads only the shape of its "original weight" when the rows match the packing
        self.shape = torch.zeros(1).expand(sum(lin.out_features for lin in linears), linears[0].in_features)

    def _source(self) -> torch.Tensor:
        weights = [lin.weight.detach() for lin in self.linears]
        return torch.cat(weights) if len(weights) > 1 else weights[0]

    def __call__(self, x: torch.Tensor, may_pack: bool = True) -> torch.Tensor:
        """``x @ W.T + b``; ``may_pack``: enough steps remain to repay packing for a new row count."""
        if self.onednn is not None:
            return _onednn_linear(x, self.onednn, self.bias)
        if self.weight is not None:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        if rows < PACK_MIN_ROWS:
            self.packed, self.rows = None, 0  # not used again: rows only leave
            return self._unpacked(x)
        if self.rows // 2 <= rows < self.rows:  # rows left the batch: pad rather than pack again
            padded = torch.cat([x, x.new_zeros(self.rows - rows, x.shape[1])])
            return torch.ops.mkl._mkl_linear(padded, self.packed, self.shape, self.bias, self.rows)[:rows]
        if rows != self.rows:
            self.packed, self.rows = None, 0
            if not may_pack:
                return self._unpacked(x)
            with mapped_allocations():  # MKL allocates 2x what it fills: keep that out of the heap
                self.packed, self.rows = torch.ops.mkl._mkl_reorder_linear_weight(self._source(), rows), rows
        return torch.ops.mkl._mkl_linear(x, self.packed, self.shape, self.bias, rows)

    def _unpacked(self, x: torch.Tensor) -> torch.Tensor:
        outs = [F.linear(x, lin.weight, lin.bias) for lin in self.linears]
        return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]


class _Layer:
    def __init__(self, layer: nn.Module, dtype: torch.dtype, backend: str = "mkl"):
        attn = layer.self_attn
        self.qkv, self.o, self.gate_up, self.down = (_Weight(group, dtype, backend) for group in self.projections(layer))
        self.norm_in, self.norm_post = layer.input_layernorm, layer.post_attention_layernorm
        self.scale = getattr(attn, "scaling", attn.head_dim ** -0.5)
        self.shared_keys: torch.Tensor | None = None  # [Hkv, S, d]: the beginning every prompt shares, once
        self.shared_values: torch.Tensor | None = None
        self.prompt_keys: torch.Tensor | None = None  # [G, Hkv, P - S, d]: each distinct prompt once
        self.prompt_values: torch.Tensor | None = None
        self.keys: torch.Tensor | None = None  # [B, Hkv, capacity, d]: each row's generated tokens
        self.values: torch.Tensor | None = None

    @staticmethod
    def projections(layer: nn.Module) -> tuple[list[nn.Linear], ...]:
        """The layer's projections as the step multiplies them: q/k/v fused, o, gate/up fused, down."""
        attn, mlp = layer.self_attn, layer.mlp
        return [attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]


class LeanDecoder:
    """Decoding steps over a prefilled ``transformers`` cache of distinct prompts (see module doc).

    The prompts' keys and values stay one copy per prompt, however many samples decode from it:
    a row's attention reads its prompt's copy (the queries of a prompt's samples multiplied
    against it together) and its own generated tokens' buffer. With ``n`` samples per prompt
    a step reads the prompts' cache once instead of ``n`` times.

    Args:
        body: the model's backbone (``embed_tokens``, ``rotary_emb``, ``layers``, ``norm``).
        head: the output projection; ``softcap``: final logit soft-capping or None.
        dtype: the matmuls' precision (float32, or bfloat16 under autocast).
    """

    def __init__(self, body: nn.Module, head: nn.Linear, softcap: float | None, dtype: torch.dtype):
        cfg = body.config
        self.body, self.softcap, self.dtype = body, softcap, dtype
        backend = fp32_matmul_backend(list(_Layer.projections(body.layers[0]))) if dtype == torch.float32 else "mkl"
        self.head = _Weight([head], dtype, backend)  # bf16 and float64 ignore the backend
        self.layers = [_Layer(layer, dtype, backend) for layer in body.layers]
        self.q_heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.prompt_len = self.length = 0  # prompt positions; generated positions cached so far
        self.shared_len = 0  # the first prompt positions, the same in every prompt, kept once
        self.prompts = self.samples = 1
        self.slot = torch.zeros(0, dtype=torch.long)  # [B]: prompt * samples + sample of each decoding row

    # ------------------------------------------------------------------ cache
    def load_cache(self, cache: Any, new_tokens: int, samples: int = 1, shared: int = 0) -> None:
        """Take a prefilled cache of ``G`` prompts (``cache`` is left empty) for ``G * samples`` rows
        (each prompt's samples consecutive), with room for ``new_tokens`` generated positions.

        ``shared``: the cache's first positions hold the same keys and values in every prompt (the
        engine prefilled a beginning the prompts share once and repeated it): they are kept once,
        and every row's query meets them in one product instead of each prompt's copy being read.
        The built-in run's 128 validation prompts share 63 of their 76 positions."""
        with mapped_allocations():
            self._load_cache(cache, new_tokens, samples, shared)

    def _load_cache(self, cache: Any, new_tokens: int, samples: int, shared: int = 0) -> None:
        # under autocast the cache holds float32 keys (rotated in float32) that every step's bf16 matmul
        # would cast again: cast once here instead (the same rounding, so the same scores)
        half = self.dtype in (torch.bfloat16, torch.float16)
        for layer, cached in zip(self.layers, cache.layers):
            prompts, heads, length, dim = cached.keys.shape
            keys = cached.keys.to(self.dtype) if half else cached.keys
            if shared:  # one copy of the shared beginning; each prompt keeps only its own positions
                layer.shared_keys = keys[0, :, :shared].clone()
                layer.shared_values = cached.values[0, :, :shared].clone()
                layer.prompt_keys = keys[:, :, shared:].clone()
                layer.prompt_values = cached.values[:, :, shared:].clone()
            else:
                layer.prompt_keys, layer.prompt_values = keys, cached.values  # moved: no copy (but the cast)
            layer.keys = keys.new_empty(prompts * samples, heads, new_tokens, dim)
            layer.values = cached.values.new_empty(prompts * samples, heads, new_tokens, dim)
            cached.keys = cached.values = cached.keys.new_empty(0)
            self.prompts, self.prompt_len = prompts, length
        self.samples, self.length, self.shared_len = samples, 0, shared
        self.slot = torch.arange(self.prompts * samples, device=self.layers[0].keys.device)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (indices); the prompts' cache stays. The kept rows move to
        the front of the same buffers (through one layer's temporary copy at a time) instead of
        into a new cache at every row change, whose freed predecessors left holes in the heap."""
        self.slot = self.slot[rows]
        kept = rows.shape[0]
        for layer in self.layers:
            layer.keys[:kept] = layer.keys[rows]
            layer.values[:kept] = layer.values[rows]
            layer.keys, layer.values = layer.keys[:kept], layer.values[:kept]

    def _grow(self) -> None:
        for layer in self.layers:
            layer.keys = torch.cat([layer.keys, torch.empty_like(layer.keys)], dim=2)
            layer.values = torch.cat([layer.values, torch.empty_like(layer.values)], dim=2)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, tokens: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """tokens ``[B, 1]``, mask ``[B, L]`` (L = prompt + generated positions + 1), positions ``[B, 1]`` -> logits ``[B, V]``."""
        if self.length >= self.layers[0].keys.shape[2]:
            self._grow()
        batch, pos, d = tokens.shape[0], self.length, self.head_dim
        pack = self.layers[0].keys.shape[2] - pos >= REPACK_MIN_STEPS
        hidden = self.body.embed_tokens(tokens)  # [B, 1, H]
        cos, sin = self.body.rotary_emb(hidden, position_ids)  # [B, 1, d], float32 as in the model's forward
        cos, sin = cos[:, :, None], sin[:, :, None]  # [B, 1, 1, d]: broadcast over heads
        hidden = hidden[:, 0]  # [B, H]
        rotated = self.q_heads + self.kv_heads
        attend = attention_mask[:, None, None, :self.prompt_len + pos + 1].bool()  # [B, 1, 1, L]
        for layer in self.layers:
            qkv = layer.qkv(layer.norm_in(hidden).to(self.dtype), pack).view(batch, 1, -1, d)
            # q and k heads rotated together: the model's apply_rotary_pos_emb, elementwise, in half the ops
            qk = qkv[:, :, :rotated]
            q, k = (qk * cos + rotate_half(qk) * sin).split([self.q_heads, self.kv_heads], dim=2)  # [B, 1, heads, d]
            v = qkv[:, :, rotated:]
            layer.keys[:, :, pos] = k[:, 0]
            layer.values[:, :, pos] = v[:, 0]
            attn = self._attention(layer, q[:, 0].to(layer.keys.dtype), attend)  # [B, Hq, d]
            hidden = hidden + layer.o(attn.reshape(batch, -1).to(self.dtype), pack)
            gate, up = layer.gate_up(layer.norm_post(hidden).to(self.dtype), pack).chunk(2, dim=-1)
            hidden = hidden + layer.down(F.silu(gate) * up, pack)
        self.length = pos + 1
        logits = self.head(self.body.norm(hidden).to(self.dtype), pack)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _attention(self, layer: _Layer, query: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """query ``[B, Hq, d]`` against the row's prompt and generated tokens -> ``[B, Hq, d]``.

        Grouped-query heads packed (head ``h`` reads kv head ``h // g``); scores of the shared
        beginning, of the prompt and of the row's own tokens normalised together by
        ``single_query_probs``."""
        batch, dim, kv_heads, shared = query.shape[0], self.head_dim, self.kv_heads, self.shared_len
        q = query.reshape(batch, kv_heads, -1, dim)  # [B, Hkv, g, d]
        keys, values = layer.keys[:, :, :self.length + 1], layer.values[:, :, :self.length + 1]
        prompt = self._per_row(torch.matmul(self._per_prompt(q), layer.prompt_keys.transpose(-1, -2)))
        own = torch.matmul(q, keys.transpose(-1, -2))
        if shared:
            every_row = q.transpose(0, 1).reshape(kv_heads, -1, dim)  # [Hkv, B * g, d]
            beginning = torch.bmm(every_row, layer.shared_keys.transpose(1, 2)).view(kv_heads, batch, -1, shared)
            scores = torch.cat([beginning.transpose(0, 1), prompt, own], dim=-1)  # [B, Hkv, g, L]
        else:
            scores = torch.cat([prompt, own], dim=-1)
        probs = single_query_probs(scores, attend, layer.scale, values.dtype)
        out = torch.matmul(probs[..., self.prompt_len:], values)
        out = out + self._per_row(torch.matmul(self._per_prompt(probs[..., shared:self.prompt_len]),
                                               layer.prompt_values))
        if shared:
            weights = probs[..., :shared].transpose(0, 1).reshape(kv_heads, -1, shared)  # [Hkv, B * g, S]
            out = out + torch.bmm(weights, layer.shared_values).view(kv_heads, batch, -1, dim).transpose(0, 1)
        return out.reshape(batch, self.q_heads, dim)

    def _per_prompt(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, g, m]`` per decoding row -> ``[G, Hkv, samples * g, m]`` per prompt (rows that
        have ended as zeros)."""
        if x.shape[0] != self.prompts * self.samples:
            x = x.new_zeros(self.prompts * self.samples, *x.shape[1:]).index_copy_(0, self.slot, x)
        _, kv_heads, group, m = x.shape
        return x.view(self.prompts, self.samples, kv_heads, group, m).transpose(1, 2).reshape(
            self.prompts, kv_heads, self.samples * group, m)

    def _per_row(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`_per_prompt`, for the rows still decoding."""
        kv_heads, m = y.shape[1], y.shape[-1]
        y = y.view(self.prompts, kv_heads, self.samples, -1, m).transpose(1, 2).reshape(
            self.prompts * self.samples, kv_heads, -1, m)
        return y if self.slot.shape[0] == y.shape[0] else y.index_select(0, self.slot)  # 1/2-1/10 of y[slot]'s time


def lean_decoder_for(model: nn.Module, cache: Any) -> LeanDecoder | None:
    """A :class:`LeanDecoder` for ``model`` after a prefill that produced ``cache``, or None where it
    would not reproduce the model's own step (see module doc)."""
    from posttrain.models.logprobs import split_lm

    parts = split_lm(model)
    if parts is None or not _supported(model, parts[0], parts[1], cache):
        return None
    autocast = torch.is_autocast_enabled("cpu")
    dtype = torch.get_autocast_dtype("cpu") if autocast else parts[1].weight.dtype
    with mapped_allocations():  # this generation's weight copies: unmapped when it ends, no heap holes
        return LeanDecoder(parts[0], parts[1], parts[2], dtype)


def _supported(model: nn.Module, body: nn.Module, head: nn.Module, cache: Any) -> bool:
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in LEAN_MODEL_TYPES:
        return False
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "sliding_window", None) and (
            cfg.model_type == "mistral" or getattr(cfg, "use_sliding_window", False)):
        return False
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return False
    layers = getattr(body, "layers", None)
    if not layers or not all(hasattr(body, a) for a in ("embed_tokens", "rotary_emb", "norm")):
        return False
    linears = [head] + [proj for layer in layers for proj in (
        getattr(layer.self_attn, "q_proj", None), getattr(layer.self_attn, "k_proj", None),
        getattr(layer.self_attn, "v_proj", None), getattr(layer.self_attn, "o_proj", None),
        getattr(layer.mlp, "gate_proj", None), getattr(layer.mlp, "up_proj", None),
        getattr(layer.mlp, "down_proj", None))]
    # RecastLinear computes nn.Linear's function (it only keeps less for backward); any other subclass may not
    if not all(type(lin) in (nn.Linear, RecastLinear) and type(lin.weight.detach()) is torch.Tensor for lin in linears):
        return False
    if head.weight.device.type != "cpu":  # CPU only: MKL packing and CPU autocast (a GPU keeps the model's forward)
        return False
    cached = getattr(cache, "layers", None)
    return bool(cached) and len(cached) == len(layers) and all(
        getattr(c, "keys", None) is not None and getattr(c, "values", None) is not None for c in cached)
