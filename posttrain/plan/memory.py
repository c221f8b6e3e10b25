"""A per-GPU memory estimate for each role and each phase of a training step.

The model, stated so a reader can check it (bytes per parameter P, per token T, per layer):

- Trained roles (actor, critic) under FSDP: fp32 master parameters (4 B, `fsdp_config.model_dtype`),
  fp32 gradients (4 B, only during the update), AdamW m and v in fp32 (8 B): 16 B/param, the
  ZeRO-3 figure for mixed-precision Adam (Rajbhandari et al. 2019, sec. 3.1: 2+2+12 B). All three
  are sharded across the FSDP group (`fsdp_size`, -1: all ranks). `param_offload` /
  `optimizer_offload` keep them in CPU memory outside the role's own phase.
- FSDP gathers one unit at a time for compute, in bf16: the largest unit (a decoder layer or the
  embedding), twice during backward (unsharded parameters and gradients).
- Activations saved for backward in a Llama-style layer with flash attention, bf16:
  (16 h + 8 i) B per token per layer (Korthikanti et al. 2022, sec. 4.1, recounted for RMSNorm,
  a SwiGLU MLP, no dropout and no s^2 attention scores). Gradient checkpointing keeps only each
  layer's input (2 h B per token per layer) plus one layer recomputed during backward. A forward
  pass without gradients (log-probs, values) holds one layer's live tensors: (4 h + 4 i) B per token.
- Logits (`posttrain.models.logprobs`): the lm_head runs on response positions only, in chunks of 16M
  logits turned to float32 one at a time; a training micro-batch of up to 64M response logits keeps them
  all for backward in the compute dtype (its backward works in slices of a chunk), a larger one keeps
  none and recomputes each chunk in backward (one float32 chunk live).
- `actor.use_prefix_grouper`: each distinct prompt of a micro-batch is encoded once for its responses
  (rows of one prompt are kept together): ceil(micro / rollout.n) prompts + micro responses per micro-batch.
- Reward model (`reward_model.enable`): frozen like the reference (parameters in `model_dtype`,
  sharded, `param_offload` honoured), a forward without gradients and no logits (one score per
  row); its shape from its own config.json when at hand, tokens per sequence up to `max_length`.
- Rollout engine (vllm): takes `gpu_memory_utilization` x GPU memory; of that, bf16 weights P x 2
  (a full copy on every rank: the engine runs with tensor parallel size 1 whatever
  `rollout.tensor_model_parallel_size` says) and the rest KV cache (the engine's own activation
  reserve is ignored). KV per token: 2 (K and V) x layers x kv_heads x head_dim x 2 B.
- Roles are colocated (verl's hybrid engine): every GPU holds each role's resident shards, and the
  phases of a step (rollout, log-probs, values, updates) run one after another; the peak is the
  largest phase.
- Tokens per sequence: max prompt + max response length (the worst case) unless `--mean-tokens`
  gives a typical length; with use_remove_padding, memory follows the real lengths.
- LoRA (`model.lora_rank > 0`): the frozen base keeps its master weights, but gradients and AdamW
  state exist for the adapters alone, r x (in + out) parameters per adapted Llama projection; no
  reference model is loaded (the actor with its adapters disabled computes the reference
  log-probs, verl's ref in actor), so the reference phase costs only its activations. Activations
  are counted as in full fine-tuning (the adapters' own are small beside them).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from posttrain.config.derived import uses_critic, uses_reference
from posttrain.config.schema import PostTrainConfig
from posttrain.plan.flow import REWARD_MODEL_PASS, TEACHER_PASS, Flow
from posttrain.plan.model_dims import ModelDims

GiB = 1024**3
MASTER_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
GRAD_BYTES = 4
"""fp32 gradients, in the master parameters' dtype."""
ADAM_BYTES = 8
"""AdamW's m and v, fp32."""
COMPUTE_BYTES = 2
"""bf16 compute copies, activations, logits, rollout weights and KV cache."""
TIGHT_FRACTION = 0.9
"""Above this fraction of GPU memory, fragmentation and allocator overhead make OOM likely."""

ASSUMPTIONS = (
    "trained roles: fp32 params 4 B + fp32 grads 4 B + AdamW m,v 8 B = 16 B/param, sharded across the FSDP group",
    "one FSDP unit (largest of a decoder layer and the embedding) gathered in bf16, x2 during backward",
    "activations saved per token per layer: (16 h + 8 i) B in bf16 (Korthikanti et al. 2022, flash attention, SwiGLU); "
    "with gradient checkpointing 2 h B plus one recomputed layer; forward without gradients (4 h + 4 i) B",
    "logits: response tokens x vocab, one float32 chunk of 16M live; a training micro-batch keeps up to 64M of them "
    "for backward in the compute dtype",
    "rollout engine: gpu_memory_utilization x GPU memory = the full bf16 weights (TP 1 on every rank) + KV cache "
    "(2 x layers x kv_heads x head_dim x 2 B per token)",
    "roles colocated on every GPU; phases run one after another; peak = largest phase",
)


@dataclass(frozen=True)
class Term:
    name: str
    bytes: Optional[float]
    """None when the model's shape is unknown."""
    note: str = ""


@dataclass(frozen=True)
class Phase:
    name: str
    terms: tuple[Term, ...]

    @property
    def total(self) -> float:
        return sum(t.bytes or 0 for t in self.terms)

    @property
    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes or 0)


@dataclass(frozen=True)
class MemoryEstimate:
    gpu_memory: float
    tokens_per_sequence: int
    tokens_note: str
    dims: dict[str, Any]
    roles: dict[str, dict[str, Any]]
    """Per role: named byte counts (None: not estimable) and notes."""
    phases: tuple[Phase, ...]
    peak_phase: str
    peak: float
    largest_term: str
    level: str
    """fits, tight, may_oom (only at worst-case lengths) or likely_oom."""
    verdict: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    assumptions: tuple[str, ...] = ASSUMPTIONS
    unit: str = "GPU"
    """What one share of the budget is: a GPU, or on a CPU run one process (the budget: the machine's RAM)."""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["phases"] = [{"name": p.name, "total": p.total, "terms": [asdict(t) for t in p.terms]} for p in self.phases]
        return out


def parse_bytes(text: str) -> float:
    """'80GiB' -> 80 x 2**30, '141GB' -> 141e9, '80' -> 80 GiB (`posttrain.cli_args.bytes_from_text`)."""
    from posttrain.cli_args import bytes_from_text

    return bytes_from_text(text)


def fmt_bytes(n: Optional[float]) -> str:
    return "?" if n is None else f"{n / GiB:.1f} GiB"


# ---- formulas (each checked against a published figure in tests/plan) ----

def model_state_bytes_per_param(master_dtype: str = "fp32") -> int:
    """Parameters + gradients + AdamW state of a trained role: 16 B with fp32 master weights."""
    return MASTER_DTYPE_BYTES[master_dtype] + GRAD_BYTES + ADAM_BYTES


def kv_bytes_per_token(dims: ModelDims, tp: int = 1, dtype_bytes: int = COMPUTE_BYTES) -> float:
    """K and V of every layer for one token on one tensor-parallel rank (kv heads split, at least one each)."""
    kv_heads_per_rank = max(1, math.ceil(dims.kv_heads / tp))
    return 2 * dims.layers * kv_heads_per_rank * dims.head_dim * dtype_bytes


def layer_activation_bytes_per_token(dims: ModelDims) -> float:
    """bf16 tensors one decoder layer saves for backward, per token: 16 h + 8 i."""
    return 16 * dims.hidden + 8 * dims.intermediate


def forward_activation_bytes_per_token(dims: ModelDims) -> float:
    """Live bf16 tensors of one layer in a forward pass without gradients, per token: residual stream,
    layer output and two MLP projections, 4 h + 4 i (earlier layers' tensors are already freed)."""
    return 4 * dims.hidden + 4 * dims.intermediate


def training_activation_bytes(dims: ModelDims, tokens: float, checkpointing: bool) -> float:
    """Saved activations of a micro-batch of `tokens` tokens (logits excluded)."""
    per_layer = layer_activation_bytes_per_token(dims) * tokens
    if not checkpointing:
        return dims.layers * per_layer
    return dims.layers * 2 * dims.hidden * tokens + per_layer


def logits_bytes(dims: ModelDims, response_tokens: float, training: bool, compute_bytes: int = COMPUTE_BYTES) -> float:
    """Live logits of a micro-batch with ``response_tokens`` scored tokens (`posttrain.models.logprobs`, step 4):
    one float32 chunk at a time; a training micro-batch of at most ``KEEP_ELEMENTS`` logits also keeps all of
    them for backward in the compute dtype, whose backward then works in slices of a chunk (a larger one keeps
    none and recomputes each chunk in the compute dtype: under the float32 chunk of its forward). Assumes a
    plain linear head; a softcapped or adapter-wrapped one keeps float32 softmaxes (twice ``compute_bytes``)."""
    from posttrain.models.lean.head import CHUNK_ELEMENTS, KEEP_ELEMENTS

    elements = response_tokens * dims.vocab
    chunk = min(elements, CHUNK_ELEMENTS) * 4
    if training and elements <= KEEP_ELEMENTS:
        return elements * compute_bytes + chunk
    return chunk


def gathered_unit_bytes(dims: ModelDims, dtype_bytes: int = COMPUTE_BYTES) -> float:
    """The largest FSDP unit in the compute dtype: a decoder layer or the embedding matrix."""
    return dtype_bytes * max(dims.params_per_layer, dims.vocab * dims.hidden)


# Llama-style projections LoRA can adapt: (block, name, input width, output width).
def _projections(d: ModelDims) -> list[tuple[str, str, int, int]]:
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    return [("self_attn", "q_proj", d.hidden, q), ("self_attn", "k_proj", d.hidden, kv),
            ("self_attn", "v_proj", d.hidden, kv), ("self_attn", "o_proj", q, d.hidden),
            ("mlp", "gate_proj", d.hidden, d.intermediate), ("mlp", "up_proj", d.hidden, d.intermediate),
            ("mlp", "down_proj", d.intermediate, d.hidden)]


def _name_matches(pattern: Any, name: str) -> bool:
    """peft's rule: a string is a regex on the full module name; a list entry equals it or its last parts."""
    import re

    if isinstance(pattern, str):
        return re.fullmatch(pattern, name) is not None
    return any(name == p or name.endswith("." + str(p)) for p in pattern)


def lora_settings_of(model_config: Any) -> Optional[tuple[int, Any, Any]]:
    """(rank, target_modules, exclude_modules) of a role's model section, or None without LoRA; with
    ``lora_adapter_path`` the adapter folder's own ``adapter_config.json`` (when it is here)."""
    import json
    from pathlib import Path

    path = getattr(model_config, "lora_adapter_path", None)
    if path:
        try:
            saved = json.loads((Path(path).expanduser() / "adapter_config.json").read_text())
            return int(saved["r"]), saved.get("target_modules") or "all-linear", saved.get("exclude_modules")
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if model_config.lora_rank <= 0 and not path:
        return None
    return model_config.lora_rank, model_config.target_modules, getattr(model_config, "exclude_modules", None)


def lora_param_count(dims: ModelDims, rank: int, target_modules: Any, exclude_modules: Any = None) -> Optional[float]:
    """Adapter parameters: r x (in + out) for each adapted projection of each decoder layer (all-linear:
    every projection; the LM head is never adapted by all-linear). None without the model's shape."""
    if not dims.has_shape or rank <= 0:
        return None
    total = 0
    for layer in range(dims.layers):
        for block, proj, fan_in, fan_out in _projections(dims):
            name = f"model.layers.{layer}.{block}.{proj}"
            chosen = target_modules == "all-linear" or _name_matches(target_modules, name)
            if chosen and not (exclude_modules is not None and _name_matches(exclude_modules, name)):
                total += rank * (fan_in + fan_out)
    return float(total)


# ---- per-role and per-phase estimates ----

@dataclass(frozen=True)
class _Ctx:
    config: PostTrainConfig
    flow: Flow
    dims: ModelDims
    tokens: int
    gpu: float
    compute_bytes: int = COMPUTE_BYTES
    """Bytes of a compute-dtype value: 2 (bf16, GPUs' and bf16 CPUs'), 4 on a CPU that computes in fp32."""
    on_cpu: bool = False
    one_process: bool = False
    """A one-process CPU run (`posttrain.distributed.placement.InProcess`), whose levers differ from ranks'."""
    adam_bytes: float = ADAM_BYTES
    """AdamW's m and v per trained parameter: 8 (fp32), 2 with 8-bit moments (posttrain.optim.adamw8bit)."""

    @property
    def act_scale(self) -> float:
        """Activation formulas are in bf16 bytes; an fp32 compute doubles them."""
        return self.compute_bytes / COMPUTE_BYTES

    @property
    def shaped(self) -> bool:
        return self.dims.has_shape

    def micro_tokens(self, micro: int, grouped: bool = False) -> float:
        """Tokens one GPU holds for `micro` sequences (Ulysses sequence parallelism splits each sequence);
        ``grouped`` (use_prefix_grouper): each prompt once for its rollout.n responses."""
        prompts = math.ceil(micro / max(1, self.config.actor_rollout_ref.rollout.n)) if grouped else micro
        return (prompts * self.prompt_share + micro * (1 - self.prompt_share)) * self.tokens / self.flow.sequence_parallel

    @property
    def prompt_share(self) -> float:
        """The prompt's share of a sequence's tokens (max prompt / (max prompt + max response))."""
        whole = self.flow.prompt_length + self.flow.response_length
        return self.flow.prompt_length / whole if whole else 0.0


def _fsdp_ranks(fsdp_size: int, world: int) -> int:
    return fsdp_size if 0 < fsdp_size <= world else world


def _tokens(ctx: _Ctx, micro: Optional[int], dynamic: bool, budget: int,
            grouped: bool = False) -> tuple[Optional[float], Optional[float]]:
    """(tokens, scored response tokens) of one micro-batch on one GPU: rows x tokens per sequence (prompts
    once per group when ``grouped``), or the dynamic token budget; (None, None) when unknown."""
    response = 1 - ctx.prompt_share
    if dynamic:
        return float(budget), budget * response
    if micro is None:
        return None, None
    return ctx.micro_tokens(micro, grouped), micro * response * ctx.tokens / ctx.flow.sequence_parallel


def _trained_role(ctx: _Ctx, fsdp, update: tuple, forward: tuple, checkpointing: bool,
                  has_lm_head: bool, lora: Optional[tuple[int, Any, Any]] = None) -> dict[str, Any]:
    """``update`` / ``forward``: (tokens, scored tokens) of a micro-batch of the update / the forward pass."""
    (tokens, scored), (fwd_tokens, fwd_scored) = update, forward
    ranks = _fsdp_ranks(fsdp.fsdp_size, ctx.flow.world_size)
    p = ctx.dims.params
    adapters = lora_param_count(ctx.dims, *lora) if lora else None
    # LoRA: unknown shape -> adapters not countable; the gradients and optimizer state are then left at 0
    trained = p if lora is None else (adapters or 0.0)
    out: dict[str, Any] = {
        "fsdp_ranks": ranks, "on_cpu": ctx.on_cpu,
        "params": (p + (adapters or 0.0)) * MASTER_DTYPE_BYTES.get(fsdp.model_dtype, 4) / ranks,
        "params_offloaded": fsdp.param_offload,
        "grads": trained * GRAD_BYTES / ranks,
        "optimizer": trained * ctx.adam_bytes / ranks,
        "optimizer_offloaded": fsdp.optimizer_offload or (ctx.adam_bytes == 2 and _pages_idle_state(ctx, fsdp)),
        "gradient_checkpointing": checkpointing,
        "micro_batch_tokens": tokens,
        "forward_tokens": fwd_tokens,
    }
    if lora is not None:
        out["lora_rank"], out["lora_params"] = lora[0], adapters
    if ctx.shaped:
        d = ctx.dims
        out["gathered_unit"] = gathered_unit_bytes(d, ctx.compute_bytes)
        if tokens is not None:
            out["activations_gc"] = training_activation_bytes(d, tokens, True) * ctx.act_scale
            out["activations_no_gc"] = training_activation_bytes(d, tokens, False) * ctx.act_scale
            out["activations"] = out["activations_gc" if checkpointing else "activations_no_gc"]
            out["logits"] = logits_bytes(d, scored, True, ctx.compute_bytes) if has_lm_head else 0.0
        if fwd_tokens is not None:
            out["forward_activations"] = forward_activation_bytes_per_token(d) * fwd_tokens * ctx.act_scale
            out["forward_logits"] = logits_bytes(d, fwd_scored, False) if has_lm_head else 0.0
    return out


def _reference_role(ctx: _Ctx, forward: tuple, in_actor: bool = False) -> dict[str, Any]:
    """The reference's own copy of the model, or with ``in_actor`` (LoRA) none: the actor computes it.
    ``forward``: (tokens, scored tokens) of a micro-batch."""
    tokens, scored = forward
    fsdp = ctx.config.actor_rollout_ref.ref.fsdp_config
    ranks = ctx.flow.world_size
    own = ctx.dims.params * _frozen_bytes(ctx, fsdp.model_dtype) / ranks
    out: dict[str, Any] = {
        "fsdp_ranks": ranks, "on_cpu": ctx.on_cpu,
        "params": 0.0 if in_actor else own,
        "params_offloaded": fsdp.param_offload or _pages_idle_state(ctx, fsdp),
        "forward_tokens": tokens,
    }
    if in_actor:
        out["in_actor"], out["params_saved"] = True, own
    if ctx.shaped:
        d = ctx.dims
        out["gathered_unit"] = gathered_unit_bytes(d, ctx.compute_bytes)
        if tokens is not None:
            out["forward_activations"] = forward_activation_bytes_per_token(d) * tokens * ctx.act_scale
            out["forward_logits"] = logits_bytes(d, scored, False)
    return out


def _pages_idle_state(ctx: _Ctx, fsdp: Any) -> bool:
    """Whether a one-process CPU run pages this role's idle state to a file (``fsdp_config.host_paging``, as
    `posttrain.host.memory_plan.MemoryPlan.idle_state_directory` decides it on this machine)."""
    if not (ctx.on_cpu and ctx.one_process):
        return False
    import torch

    from posttrain.errors import ConfigError
    from posttrain.host.memory_plan import MemoryPlan

    try:
        return MemoryPlan(torch.device("cpu")).idle_state_directory(getattr(fsdp, "host_paging", "auto"), "") is not None
    except ConfigError:  # on, with a tmpfs: the run refuses it at start-up
        return False


def _frozen_bytes(ctx: _Ctx, model_dtype: str) -> int:
    """Bytes a frozen role keeps per parameter: on a one-process CPU run that computes in bf16 its weights
    are kept in bf16 (ranks keep ``model_dtype``) (`posttrain.distributed.placement.store_frozen_in_bf16`), else in ``model_dtype``."""
    if ctx.on_cpu and ctx.one_process and ctx.compute_bytes == 2:
        return 2
    return MASTER_DTYPE_BYTES.get(model_dtype, 4)


def _reward_model_role(ctx: _Ctx, tokens: Optional[float]) -> dict[str, Any]:
    """Frozen like the reference, sharded over all ranks; one score per row instead of logits."""
    fsdp = ctx.config.reward_model.model.fsdp_config
    ranks = ctx.flow.world_size
    out: dict[str, Any] = {
        "fsdp_ranks": ranks, "on_cpu": ctx.on_cpu,
        "params": ctx.dims.params * _frozen_bytes(ctx, fsdp.model_dtype) / ranks,
        "params_offloaded": fsdp.param_offload or _pages_idle_state(ctx, fsdp),
        "forward_tokens": tokens,
    }
    if ctx.shaped:
        out["gathered_unit"] = gathered_unit_bytes(ctx.dims, ctx.compute_bytes)
        if tokens is not None:
            out["forward_activations"] = forward_activation_bytes_per_token(ctx.dims) * tokens * ctx.act_scale
    return out


def _reward_model_dims(config: PostTrainConfig, actor_dims: ModelDims) -> tuple[ModelDims, Optional[str]]:
    """The reward model's shape from its config.json (a scalar head in place of the LM head), else the
    actor's, with a note saying so."""
    from posttrain.plan.model_dims import find_model_config, read_model_config, value_model_dims

    path = config.reward_model.model.path
    found = find_model_config(path)
    if found is not None:
        try:
            return value_model_dims(read_model_config(found)), None
        except (OSError, ValueError):
            pass
    return value_model_dims(actor_dims), f"reward model {path}: config.json not at hand, the actor's shape assumed"


def _teacher_dims(config: PostTrainConfig, actor_dims: ModelDims) -> tuple[ModelDims, int, Optional[str]]:
    """The largest teacher's shape from its config.json (else the actor's, with a note) and how many teachers."""
    from posttrain.config.distillation import resolve_teachers
    from posttrain.plan.model_dims import find_model_config, read_model_config

    try:
        paths = [t.model_path for t in resolve_teachers(config).values() if t.model_path]
    except ValueError:
        paths = []
    found = []
    for path in paths:
        config_json = find_model_config(path)
        try:
            found.append(read_model_config(config_json)) if config_json is not None else None
        except (OSError, ValueError):
            pass
    if found and len(found) == len(paths):
        return max(found, key=lambda d: d.params or 0), len(paths), None
    return actor_dims, max(1, len(paths)), "teacher: config.json not at hand, the actor's shape assumed"


def _rollout_role(ctx: _Ctx) -> dict[str, Any]:
    r, f, d = ctx.config.actor_rollout_ref.rollout, ctx.flow, ctx.dims
    seq = ctx.tokens
    weights = d.params * ctx.compute_bytes / f.rollout_tp
    out: dict[str, Any] = {"engine": r.name, "tensor_parallel": f.rollout_tp, "weights": weights,
                           "dtype": "bf16" if ctx.compute_bytes == 2 else "fp32", "on_cpu": ctx.on_cpu}
    # hf generates all of a rank's responses as one batch; vllm/sglang schedule up to max_num_seqs at once
    concurrent = f.responses_per_rank if r.name == "hf" else min(f.responses_per_worker, r.max_num_seqs)
    out["concurrent_sequences"] = concurrent
    if r.name == "hf":
        out["engine_budget"] = None
        if ctx.shaped:
            out["kv_bytes_per_token"] = kv_bytes_per_token(d, dtype_bytes=ctx.compute_bytes)
            out["kv_cache_needed"] = out["kv_cache"] = concurrent * seq * out["kv_bytes_per_token"]
        return out
    out["engine_budget"] = r.gpu_memory_utilization * ctx.gpu
    out["kv_cache"] = out["engine_budget"] - out["weights"]
    if ctx.shaped:
        per_token = kv_bytes_per_token(d, f.rollout_tp, ctx.compute_bytes)
        out["kv_bytes_per_token"] = per_token
        out["kv_cache_needed"] = concurrent * seq * per_token
        out["kv_capacity_sequences"] = max(0, int(out["kv_cache"] // (per_token * seq)))
    return out


def _state(roles: dict[str, dict[str, Any]], active: str = "", update: bool = False) -> list[Term]:
    """Parameter, optimizer and gradient shards on the GPU while `active` runs: every role's resident
    shards, plus the active role's offloaded ones (loaded for its phase) and its gradients."""
    terms = []
    for name, role in roles.items():
        if name == "rollout" or role.get("in_actor"):  # a LoRA reference has no weights of its own
            continue
        own = name == active
        if own or not role["params_offloaded"]:
            loaded = " (loaded from CPU)" if own and role["params_offloaded"] else ""
            terms.append(Term(f"{name} parameters{loaded}", role["params"]))
        if "optimizer" in role and ((own and update) or not role["optimizer_offloaded"]):
            loaded = " (loaded from CPU)" if own and role["optimizer_offloaded"] else ""
            terms.append(Term(f"{name} optimizer state{loaded}", role["optimizer"]))
        if own and update:
            terms.append(Term(f"{name} gradients", role["grads"]))
    return terms


def _tok(n: Optional[float]) -> str:
    return "" if n is None else f"{n:,.0f} tokens"


def _phases(roles: dict[str, dict[str, Any]]) -> list[Phase]:
    ro = roles["rollout"]
    if ro["engine"] == "hf":
        engine = [Term(f"rollout weights ({ro.get('dtype', 'bf16')}, full copy)", ro["weights"]), Term("rollout KV cache", ro.get("kv_cache"))]
    else:
        engine = [Term(f"rollout engine ({ro['engine']}: gpu_memory_utilization x GPU)", ro["engine_budget"],
                       f"weights {fmt_bytes(ro['weights'])} + KV cache {fmt_bytes(ro['kv_cache'])}")]
    phases = [Phase("rollout", tuple(_state(roles) + engine))]
    for phase, name in (("reward model score", "reward model"), ("old log-prob", "actor"),
                        ("reference log-prob", "reference"), (TEACHER_PASS, "teacher"), ("critic values", "critic")):
        if name in roles:
            role = roles[name]
            terms = _state(roles, active=name) + [
                Term(f"{name} gathered FSDP unit", role.get("gathered_unit")),
                Term(f"{name} forward activations", role.get("forward_activations"), _tok(role["forward_tokens"]))]
            if role.get("forward_logits"):
                terms.append(Term(f"{name} logits", role["forward_logits"]))
            phases.append(Phase(phase, tuple(terms)))
    for name in ("critic", "actor"):
        if name in roles:
            role = roles[name]
            unit = role.get("gathered_unit")
            gc = "with" if role["gradient_checkpointing"] else "without"
            terms = _state(roles, active=name, update=True) + [
                Term(f"{name} gathered FSDP unit (x2 in backward)", None if unit is None else 2 * unit),
                Term(f"{name} activations ({gc} gradient checkpointing)", role.get("activations"),
                     _tok(role["micro_batch_tokens"]) + " per micro-batch")]
            if name == "actor":
                terms.append(Term("actor logits (kept for backward + one float32 chunk)", role.get("logits")))
            phases.append(Phase(f"{name} update", tuple(terms)))
    return phases


def _scales_with_tokens(term: Term) -> bool:
    return any(word in term.name for word in ("activations", "logits", "KV"))


def _level(ctx: _Ctx, phases: list[Phase], peak: Phase, worst_case: bool) -> tuple[str, str]:
    gpu = ctx.gpu
    # What does not shrink with shorter sequences: parameters, optimizer state, the engine's share
    fixed = max(phases, key=lambda p: sum(t.bytes or 0 for t in p.terms if not _scales_with_tokens(t)))
    fixed_total = sum(t.bytes or 0 for t in fixed.terms if not _scales_with_tokens(t))
    if fixed_total > gpu:
        return "likely_oom", (f"likely out of memory in {fixed.name}: {fmt_bytes(fixed_total)} > {fmt_bytes(gpu)} before "
                              f"any activations; largest term: {fixed.largest.name} {fmt_bytes(fixed.largest.bytes)}")
    share = f"largest term: {peak.largest.name} {fmt_bytes(peak.largest.bytes)}"
    if peak.total > gpu:
        if worst_case and ctx.config.actor_rollout_ref.model.use_remove_padding:
            return "may_oom", (f"may run out of memory if responses reach max length: {peak.name} needs "
                               f"{fmt_bytes(peak.total)} of {fmt_bytes(gpu)}; {share} (use_remove_padding=True, so "
                               "memory follows real lengths: pass --mean-tokens for typical ones)")
        return "likely_oom", f"likely out of memory in {peak.name}: {fmt_bytes(peak.total)} > {fmt_bytes(gpu)}; {share}"
    if peak.total > TIGHT_FRACTION * gpu:
        return "tight", f"tight: {peak.name} needs {fmt_bytes(peak.total)} of {fmt_bytes(gpu)}; {share}"
    return "fits", f"fits: peak {fmt_bytes(peak.total)} of {fmt_bytes(gpu)} in {peak.name}; {share}"


def _verdict(ctx: _Ctx, phases: list[Phase], roles: dict[str, dict[str, Any]],
             worst_case: bool) -> tuple[str, str, list[str]]:
    """(level, one-line verdict naming the largest term, notes)."""
    notes: list[str] = []
    ro = roles["rollout"]
    if ro.get("engine_budget") is not None and ro["kv_cache"] <= 0:
        notes.append(f"the rollout engine's share ({fmt_bytes(ro['engine_budget'])}) does not hold its weights "
                     f"({fmt_bytes(ro['weights'])}): raise rollout.gpu_memory_utilization (tensor_model_parallel_size "
                     "would not help: every rank's engine holds the full weights)")
        return "likely_oom", "likely out of memory: no room for the rollout KV cache; largest term: rollout weights", notes
    if "kv_capacity_sequences" in ro and ro["kv_capacity_sequences"] < ro["concurrent_sequences"]:
        notes.append(f"the KV cache holds {ro['kv_capacity_sequences']} sequences of {ctx.tokens} tokens at once, "
                     f"fewer than the {ro['concurrent_sequences']} a rank's engine runs: the rest wait "
                     "(slower rollout, not OOM)")
    level, verdict = _level(ctx, phases, max(phases, key=lambda p: p.total), worst_case)
    if not ctx.shaped:
        verdict += " (parameters, gradients and optimizer state only)"
        notes.append("activations, logits and the KV cache are not estimated: "
                     "pass --hidden and --layers (or --model-config)")
    return level, verdict, notes


def _lora_notes(ctx: _Ctx, roles: dict[str, dict[str, Any]]) -> list[str]:
    """What LoRA saves: the reference model not loaded, gradients and AdamW state of the adapters only."""
    notes = []
    ref = roles.get("reference", {})
    if ref.get("in_actor"):
        notes.append(f"LoRA: no reference model is loaded (the actor with its adapters disabled is the reference): "
                     f"{fmt_bytes(ref['params_saved'])} per GPU saved")
    for name in ("actor", "critic"):
        role = roles.get(name, {})
        if "lora_rank" not in role:
            continue
        if role["lora_params"] is None:
            notes.append(f"LoRA {name}: adapter size unknown without the model's shape; its gradients and optimizer "
                         "state are counted as 0")
            continue
        full = ctx.dims.params * (GRAD_BYTES + ctx.adam_bytes) / role["fsdp_ranks"]
        notes.append(f"LoRA {name} (rank {role['lora_rank']}): {role['lora_params']:,.0f} trainable parameters "
                     f"({role['lora_params'] / ctx.dims.params:.2%} of the model); gradients + AdamW state "
                     f"{fmt_bytes(role['grads'] + role['optimizer'])} instead of {fmt_bytes(full)} per GPU")
    return notes


def _forward_micro(flow: Flow, name: str) -> Optional[int]:
    return next((p.micro_batch for p in flow.forward_passes if p.name == name), None)


def estimate_memory(config: PostTrainConfig, flow: Flow, dims: ModelDims, gpu_memory: float,
                    mean_tokens: Optional[int] = None, critic_dims: Optional[ModelDims] = None,
                    cpu: Optional["CpuTerms"] = None) -> MemoryEstimate:
    """Per-GPU memory of each role and phase; `dims.params` must be known (the shape is optional)."""
    worst = flow.prompt_length + flow.response_length
    tokens = min(mean_tokens, worst) if mean_tokens else worst
    note = (f"{tokens} tokens per sequence (--mean-tokens)" if mean_tokens else
            f"{worst} tokens per sequence (max prompt {flow.prompt_length} + max response {flow.response_length}: "
            "worst case)")
    dtypes = {} if cpu is None else {"compute_bytes": cpu.compute_bytes, "on_cpu": True, "one_process": cpu.one_process}
    ctx = _Ctx(config, flow, dims, tokens, gpu_memory, **dtypes,
               adam_bytes=cpu.adam_bytes(config.actor_rollout_ref.actor.optim, 0 if lora_settings_of(config.actor_rollout_ref.model) else dims.params)
               if cpu else ADAM_BYTES)
    arr = config.actor_rollout_ref
    actor, rollout, ref = arr.actor, arr.rollout, arr.ref
    actor_lora = lora_settings_of(arr.model)
    roles: dict[str, dict[str, Any]] = {
        "actor": _trained_role(
            ctx, actor.fsdp_config,
            _tokens(ctx, flow.actor.micro_batch if flow.actor else None, actor.use_dynamic_bsz,
                    actor.ppo_max_token_len_per_gpu, grouped=actor.use_prefix_grouper),
            _tokens(ctx, _forward_micro(flow, "old log-prob (actor)"), rollout.log_prob_use_dynamic_bsz,
                    rollout.log_prob_max_token_len_per_gpu, grouped=actor.use_prefix_grouper),
            arr.model.enable_gradient_checkpointing, has_lm_head=True, lora=actor_lora),
        "rollout": _rollout_role(ctx),
    }
    if uses_reference(config):
        roles["reference"] = _reference_role(ctx, _tokens(ctx, _forward_micro(flow, "reference log-prob"),
                                                          ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu,
                                                          grouped=ref.use_prefix_grouper),
                                             in_actor=actor_lora is not None)
    if uses_critic(config):
        c = config.critic
        cdims = critic_dims or dims
        cctx = _Ctx(config, flow, cdims, tokens, gpu_memory, **dtypes,
                    adam_bytes=cpu.adam_bytes(c.optim, cdims.params) if cpu else ADAM_BYTES)
        roles["critic"] = _trained_role(
            cctx, c.model.fsdp_config,
            _tokens(cctx, flow.critic.micro_batch if flow.critic else None, c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu),
            _tokens(cctx, _forward_micro(flow, "critic values"), c.use_dynamic_bsz, c.forward_max_token_len_per_gpu),
            c.model.enable_gradient_checkpointing, has_lm_head=False, lora=lora_settings_of(c.model))
    rm_note = None
    if config.reward_model.enable:
        rm = config.reward_model
        rm_dims, rm_note = _reward_model_dims(config, dims)
        rm_tokens = rm.max_length if rm.max_length and not mean_tokens else tokens  # its inputs are cut there
        rctx = _Ctx(config, flow, rm_dims, rm_tokens, gpu_memory, **dtypes)
        roles["reward model"] = _reward_model_role(rctx, _tokens(rctx, _forward_micro(flow, REWARD_MODEL_PASS),
                                                                 rm.use_dynamic_bsz, rm.forward_max_token_len_per_gpu)[0])
    teacher_note = None
    if config.distillation.enabled:  # frozen like the reference, one copy per teacher (all of them every step)
        tdims, count, teacher_note = _teacher_dims(config, dims)
        tctx = _Ctx(config, flow, tdims, tokens, gpu_memory, **dtypes)
        roles["teacher"] = _reference_role(tctx, _tokens(tctx, _forward_micro(flow, TEACHER_PASS),
                                                         ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu,
                                                         grouped=ref.use_prefix_grouper))
        roles["teacher"]["params"] *= count
    phases = _phases(roles)
    peak = max(phases, key=lambda p: p.total)
    level, verdict, notes = _verdict(ctx, phases, roles, worst_case=mean_tokens is None)
    notes = notes + _lora_notes(ctx, roles)
    notes += [rm_note] if rm_note else []
    notes += [teacher_note] if teacher_note else []
    assumptions = ASSUMPTIONS if cpu is None else (cpu.describe(),) + ASSUMPTIONS[:1] + ASSUMPTIONS[2:4] + (
        "rollout engine: the full weights on every process + KV cache (2 x layers x kv_heads x head_dim x "
        f"{cpu.compute_bytes} B per token)", "roles share every process; phases run one after another; peak = "
        "largest phase")  # a CPU run: no GPU memory share, no GPUs to colocate on
    return MemoryEstimate(gpu_memory, tokens, note, dims.as_dict(), roles, tuple(phases), peak.name, peak.total,
                          peak.largest.name, level, verdict, tuple(notes), assumptions,
                          "GPU" if cpu is None else "process")


@dataclass(frozen=True)
class CpuTerms:
    """A CPU run's terms: the budget is this machine's RAM, compute in fp32 unless the CPU has bf16
    instructions and the run asks for bf16 (``param_dtype`` bf16 or auto: the run times both and takes the
    faster; bf16 is assumed here), AdamW's moments 8-bit where ``optim.optimizer`` gives them
    (posttrain.host.memory_plan: ``auto`` on a one-process CPU run from 10M trained parameters)."""

    compute_bytes: int
    one_process: bool
    why: str
    host_memory: str = ""
    """What becomes of freed blocks (``fsdp_config.host_memory``), as the run will decide it on this machine."""

    @classmethod
    def of(cls, config: PostTrainConfig, has_bf16: bool) -> "CpuTerms":
        import torch

        from posttrain.host.memory_plan import MemoryPlan

        wanted = config.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype
        bf16 = has_bf16 and wanted in ("bf16", "bfloat16", "auto")
        why = ("bf16 compute (this CPU has bf16 instructions)" if bf16 else
               f"fp32 compute ({'param_dtype=' + str(wanted) if has_bf16 else 'this CPU has no bf16 instructions'})")
        one = config.trainer.nnodes * config.trainer.n_gpus_per_node == 1
        requested = config.actor_rollout_ref.actor.fsdp_config.host_memory
        mode = MemoryPlan(torch.device("cpu")).host_memory(requested)
        how = "chosen" if requested == "auto" else "asked"
        host = {"memory": f"freed blocks go back to the kernel (host_memory=memory, {how})",
                "speed": f"freed blocks are kept for reuse (host_memory=speed, {how}): the heap grows past these terms",
                "balanced": f"large freed blocks go back to the kernel, small ones are reused, the heap's free pages "
                            f"after each update (host_memory=balanced, {how})"}.get(mode, "")
        return cls(2 if bf16 else 4, one, why, host if one else "")

    def adam_bytes(self, optim: Any, trained_params: Optional[float]) -> float:
        """What the run's optimizer keeps per trained parameter: the spellings of `posttrain.optim.build` and,
        for ``auto``, the one-process placement's choice (`posttrain.host.memory_plan.MemoryPlan.optimizer`);
        ranks take ``auto`` as AdamW. An unknown name (an error of the plan's checks) counts as AdamW."""
        import torch

        from posttrain.host.memory_plan import MemoryPlan
        from posttrain.optim.build import OPTIMIZER_NAMES

        kind = OPTIMIZER_NAMES.get(str(getattr(optim, "optimizer", "auto") or "auto").lower(), "adamw")
        if kind == "auto":
            kind = (MemoryPlan(torch.device("cpu")).optimizer(kind, paged=False, trained_params=int(trained_params or 0))
                    if self.one_process else "adamw")
        return 2.0 if kind == "adamw_8bit" else float(ADAM_BYTES)

    def describe(self) -> str:
        host = f"; {self.host_memory}" if self.host_memory else ""
        return (f"a CPU run: the budget is this machine's RAM, one process's share; {self.why}; AdamW moments "
                "8-bit (2 B/param) where optim.optimizer gives them (auto: one process, >= 10M trained parameters); "
                f"tensors only: the process adds its libraries (~0.4 GB for torch and transformers){host}")
