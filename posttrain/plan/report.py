"""Text rendering of a Plan (the `--json` form is `Plan.as_dict()`)."""

from __future__ import annotations

import textwrap
from typing import Any, Optional

from posttrain.plan.flow import Flow, RoleUpdate, rollout_description, tensor_parallel_note
from posttrain.plan.memory import MemoryEstimate, fmt_bytes
from posttrain.plan.reward import render_reward

W = 24  # label column


def _row(label: str, text: str) -> str:
    return f"  {label:<{W}}{text}"


def _more(text: str) -> str:
    return " " * (W + 2) + text


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word}{'es' if word.endswith(('ch', 'sh', 's', 'x')) else 's'}"


def _update_lines(u: RoleUpdate, n: int, dp: int, section: str) -> list[str]:
    lines = [_row(f"{u.role} update", f"{section}.ppo_mini_batch_size={u.mini_batch_prompts} prompts x {n} = "
                  f"{u.mini_batch_responses} responses / {dp} ranks = {u.mini_batch_per_rank} per rank")]
    epochs = _plural(u.epochs, "epoch")
    lines.append(_more(f"{_plural(u.mini_batches, 'mini-batch')} x {epochs} = {u.optimizer_steps} "
                       "optimizer steps per training step"))
    if u.grad_accum is None:
        lines.append(_more("micro-batches packed by tokens (use_dynamic_bsz)"))
    else:
        lines.append(_more(f"each: {_plural(u.grad_accum, 'micro-batch')} of {u.micro_batch} "
                           f"(gradient accumulation {u.grad_accum}); "
                           f"{u.forward_backward} forward/backward passes per rank per step"))
    return lines


def placement(f: Flow) -> str:
    """Where the run computes, in the machine's terms: nodes x GPUs, or processes and threads on a CPU."""
    if f.cpu_threads is None:
        return f"{_plural(f.nnodes, 'node')} x {f.gpus_per_node} GPUs = {f.world_size} ranks"
    each = " each" if f.world_size > 1 else ""
    return f"{_plural(f.world_size, 'process')} on CPU, {_plural(f.cpu_threads, 'thread')}{each}"


def render_flow(f: Flow) -> list[str]:
    sp = f" (sequence parallel {f.sequence_parallel})" if f.sequence_parallel > 1 else ""
    out = [f"Batch flow per training step ({placement(f)}; {f.dp_size} data-parallel{sp})",
           _row("prompts", f"{f.prompts_per_step:<6}(data.train_batch_size)"),
           _row("responses", f"{f.responses_per_step:<6}= {f.prompts_per_step} prompts x rollout.n={f.n}"),
           _row("per data-parallel rank", f"{f.responses_per_rank:<6}= {f.responses_per_step} / {f.dp_size} ranks")]
    out.append(_row("rollout", rollout_description(f)))
    if tensor_parallel_note(f):
        out.append(_more(tensor_parallel_note(f)))
    out.append(_more(f"up to {f.prompt_length + f.response_length} tokens per sequence ({f.prompt_length} prompt + "
                     f"{f.response_length} response); up to {f.max_tokens_per_step:,} tokens per step"))
    if f.dynamic_sampling:
        out.append(_more(f.dynamic_sampling))
    if f.multi_turn:
        out.append(_more(f.multi_turn))
    if f.distillation:
        out.append(_row("distillation", f.distillation))
    if f.rollouts_on_disk:
        first, *rest = f.rollouts_on_disk.splitlines()
        out += [_row("rollouts on disk", first)] + [_more(line) for line in rest]
    if f.size_error:
        out.append(_row("per-rank sizes", f"not derivable: {f.size_error}"))
    for p in f.forward_passes:
        if p.rounds == 0:
            out.append(_row(p.name, "skipped: the old log-probs come from the on-policy update's own forward "
                            "(or the engine, with rollout_correction.bypass_mode)"))
        elif p.micro_batch is None:
            out.append(_row(p.name, "micro-batches packed by tokens (dynamic batch size)"))
        else:
            out.append(_row(p.name, f"{_plural(p.rounds, 'round')} of {p.micro_batch} responses per rank "
                            f"({p.key.split('.', 1)[-1] if p.key.startswith('actor_rollout_ref') else p.key})"))
    if f.critic:
        out += _update_lines(f.critic, f.n, f.dp_size, "critic")
    if f.actor:
        out += _update_lines(f.actor, f.n, f.dp_size, "actor")
    if f.steps_per_epoch is not None:
        out.append(_row("steps", f"{f.steps_per_epoch} per epoch = {f.dataset_size} prompts // {f.prompts_per_step} "
                        "(the last partial batch is dropped)"))
        out.append(_more(f"training prompts: {f.dataset_note}"))
    else:
        out.append(_row("steps", f"per epoch unknown: {f.dataset_note}"))
    if f.total_steps is not None:
        total = _more(f"{f.total_steps} training steps in total ({f.total_steps_note})")
        if f.actor:
            total += f"; {f.total_steps * f.actor.optimizer_steps} actor optimizer steps"
        out.append(total)
    return out


def render_models(models: list[dict[str, Any]]) -> list[str]:
    out = ["Models"]
    for m in models:
        state = "loaded" if m["loaded"] else "not loaded"
        name = f"{m['model']}: " if m["loaded"] and m["model"] else ""
        out.append(f"  {m['role']:<14}{state:<12}{name}{m['why']}")
    return out


def _tokens(n: Optional[float]) -> str:
    return "?" if n is None else f"{n:,.0f}"


def _where(role: dict[str, Any], offloaded: bool) -> str:
    """Where a role's state lives: GPU / CPU (offloaded) on GPUs; RAM / a file (paged) on a CPU run."""
    if role.get("on_cpu"):
        return "paged to a file between uses" if offloaded else "RAM"
    return "CPU" if offloaded else "GPU"


def _role_lines(name: str, r: dict[str, Any]) -> list[str]:
    pad = " " * 15
    if name == "rollout":
        line = f"  {'rollout':<13}weights {fmt_bytes(r['weights'])} ({r.get('dtype', 'bf16')}, the full weights on every rank)"
        if r.get("engine_budget") is not None:
            line += f"; engine share {fmt_bytes(r['engine_budget'])} leaves KV cache {fmt_bytes(r['kv_cache'])}"
        lines = [line]
        if "kv_bytes_per_token" in r:
            lines.append(pad + f"KV cache {r['kv_bytes_per_token'] / 1024:.0f} KiB per token; {r['concurrent_sequences']} "
                         f"sequences at once need {fmt_bytes(r['kv_cache_needed'])}")
        return lines
    where = _where(r, r["params_offloaded"])
    head = f"  {name:<13}params {fmt_bytes(r['params'])} ({where})"
    if r.get("in_actor"):  # LoRA: the actor with its adapters disabled
        return [f"  {name:<13}no weights of its own: the LoRA actor with its adapters disabled"]
    if "grads" in r:
        opt = _where(r, r["optimizer_offloaded"])
        head += (f", grads {fmt_bytes(r['grads'])}, optimizer {fmt_bytes(r['optimizer'])} ({opt}); "
                 f"sharded over {r['fsdp_ranks']} ranks")
    else:
        head += f"; sharded over {r['fsdp_ranks']} ranks"
    lines = [head]
    if "activations_gc" in r:
        on = "on" if r["gradient_checkpointing"] else "off"
        text = (f"update micro-batch ({_tokens(r['micro_batch_tokens'])} tokens): activations "
                f"{fmt_bytes(r['activations_gc'])} with / {fmt_bytes(r['activations_no_gc'])} without gradient "
                f"checkpointing (configured: {on})")
        if r.get("logits"):
            text += f"; logits {fmt_bytes(r['logits'])}"
        lines.append(pad + text)
    if r.get("forward_activations") is not None:
        text = (f"forward micro-batch ({_tokens(r['forward_tokens'])} tokens): "
                f"activations {fmt_bytes(r['forward_activations'])}")
        if r.get("forward_logits"):
            text += f"; logits {fmt_bytes(r['forward_logits'])}"
        lines.append(pad + text)
    return lines


def render_memory(m: Optional[MemoryEstimate], skipped: Optional[str]) -> list[str]:
    if m is None:
        return ["Memory per GPU (or per process on a CPU run)", f"  skipped: {skipped}"]
    d = m.dims
    shape = (f"hidden {d['hidden']}, {d['layers']} layers, {d['heads']} heads ({d['kv_heads']} kv), vocab {d['vocab']}, "
             f"MLP {d['intermediate']}" if d["hidden"] else "shape unknown")
    budget = "this machine's RAM, " if m.unit == "process" else ""
    out = [f"Memory per {m.unit} (of {budget}{fmt_bytes(m.gpu_memory)}; model {d['params'] / 1e9:.2f}B params, {shape}; "
           f"from {d['source']})",
           f"  {m.tokens_note}"]
    for name, role in m.roles.items():
        out += _role_lines(name, role)
    out.append(f"  phases (roles share every {m.unit}; one phase at a time):")
    for p in m.phases:
        mark = "  <- peak" if p.name == m.peak_phase else ""
        terms = ", ".join(f"{t.name} {fmt_bytes(t.bytes)}" for t in p.terms if t.bytes)
        out.append(f"    {p.name:<20}{fmt_bytes(p.total):>10}{mark}")
        out += textwrap.wrap(terms, 110, initial_indent=" " * 8, subsequent_indent=" " * 8)
    out.append(f"  verdict: {m.verdict}")
    out += [f"  note: {n}" for n in m.notes]
    out += [f"  assumed: {a}" for a in tuple(d.get("assumptions") or ()) + m.assumptions]
    return out


def render(plan) -> str:
    lines = [f"posttrain plan: {plan.source}", ""]
    lines += render_flow(plan.flow) + [""] + render_models(plan.models) + [""]
    lines += render_reward(plan.reward) + [""] if plan.reward else []
    lines += render_memory(plan.memory, plan.memory_skipped) + [""]
    lines.append(f"Problems: {_plural(len(plan.errors), 'error')}, {_plural(len(plan.warnings), 'warning')}")
    lines += [f"  error: {e}" for e in plan.errors]
    lines += [f"  warning: {w}" for w in plan.warnings]
    return "\n".join(lines)
