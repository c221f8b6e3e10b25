"""`posttrain diff A B`: compare two runs key by key, and say what the differences mean.

A and B are launch scripts, YAML configs, files of `key=value` lines, inline `key=value ...` text,
or `defaults`. Both are resolved against the defaults; every key whose value differs is printed
with both values and its documented meaning, grouped by section, followed by the consequences
that can be derived (critic or not, reference or not, rollout work, batch flow).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any, Optional

from posttrain.config.derived import estimator_needs, kl_loss_active, uses_critic, uses_reference
from posttrain.config.docs import all_keys, format_value
from posttrain.config.load import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.config.scripts import ConfigSource, explicit_keys, load_source, read_source
from posttrain.config.validate import get_key
from posttrain.plan.flow import Flow, build_flow, rollout_description

# Sections in the order a reader thinks about a run; the first matching prefix wins.
SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("algorithm", ("algorithm.",)),
    ("data", ("data.",)),
    ("actor", ("actor_rollout_ref.actor.", "actor_rollout_ref.model.", "actor_rollout_ref.")),
    ("rollout", ("actor_rollout_ref.rollout.",)),
    ("reference", ("actor_rollout_ref.ref.",)),
    ("critic", ("critic.",)),
    ("reward", ("reward_model.", "custom_reward_function.", "reward.")),
    ("trainer", ("trainer.",)),
    ("other", ("",)),
)

def _summary(estimator: str) -> str:
    """The estimator's one-line summary, declared with its registration."""
    from posttrain.algorithms import adv_estimator_spec

    try:
        return adv_estimator_spec(estimator).summary
    except ValueError:
        return "a registered estimator"


def section_of(key: str) -> str:
    """The section a dotted key is shown under (longest matching prefix)."""
    best, length = "other", -1
    for name, prefixes in SECTIONS:
        for prefix in prefixes:
            if key.startswith(prefix) and len(prefix) > length:
                best, length = name, len(prefix)
    return best


def show(value: Any) -> str:
    """A value as it would be written in an override."""
    if isinstance(value, list):
        return "[" + ",".join(show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
    return format_value(value)


@dataclass(frozen=True)
class KeyDiff:
    key: str
    a: Any
    b: Any
    a_set: Optional[str]
    """Where A sets the key (file:line), None when A takes the default."""
    b_set: Optional[str]
    doc: str
    follows: Optional[str]
    """The key this one follows (`${...}` default), when neither side sets it."""


@dataclass(frozen=True)
class ConfigDiff:
    a: str
    b: str
    keys: tuple[KeyDiff, ...]
    consequences: tuple[str, ...]
    uses: dict[str, tuple[bool, bool]]
    """{"critic": (A uses one, B uses one), "reference": (...)}."""

    def by_section(self) -> dict[str, list[KeyDiff]]:
        out: dict[str, list[KeyDiff]] = {name: [] for name, _ in SECTIONS}
        for d in self.keys:
            out[section_of(d.key)].append(d)
        return {name: diffs for name, diffs in out.items() if diffs}

    def as_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b,
                "sections": {name: [asdict(d) for d in diffs] for name, diffs in self.by_section().items()},
                "consequences": list(self.consequences), "uses": {k: list(v) for k, v in self.uses.items()}}


def diff_keys(a: PostTrainConfig, b: PostTrainConfig, a_set: dict[str, str], b_set: dict[str, str]) -> list[KeyDiff]:
    """Every leaf key whose resolved value differs, in schema order."""
    out = []
    for key, info in all_keys().items():
        if info.is_section:
            continue
        va, vb = get_key(a, key), get_key(b, key)
        if va == vb:
            continue
        explicit = key in a_set or key in b_set
        follows = None
        if not explicit and isinstance(info.default, str) and info.default.startswith("${"):
            follows = info.default[2:-1]
        out.append(KeyDiff(key, va, vb, a_set.get(key), b_set.get(key), info.doc, follows))
    return out


# ---- consequences ----

def _ratio(a: float, b: float) -> str:
    if a == 0:
        return ""
    r = b / a
    return f"{r:.0f}x" if r >= 1 and r == int(r) else f"{r:.2g}x"


def _models(c: PostTrainConfig) -> str:
    names = ["actor"] + (["reference"] if uses_reference(c) else []) + (["critic"] if uses_critic(c) else [])
    return " + ".join(names)


def _critic_consequence(a: PostTrainConfig, b: PostTrainConfig) -> list[str]:
    if uses_critic(a) == uses_critic(b):
        return []
    has, lacks = ("B", "A") if uses_critic(b) else ("A", "B")
    lacking = a if lacks == "A" else b
    having = b if has == "B" else a
    why = ("critic.enable=False" if lacking.critic.enable is False
           else f"adv_estimator={lacking.algorithm.adv_estimator} is critic-free")
    gain = "critic.enable=True" if having.critic.enable else f"adv_estimator={having.algorithm.adv_estimator} learns values"
    return [f"{lacks} has no critic: {why}; {has} trains one ({gain}): one more model's parameters, gradients "
            f"and optimizer state on every GPU, and a value pass and a critic update each step"]


def _kl_reason(c: PostTrainConfig) -> str:
    actor, algo = c.actor_rollout_ref.actor, c.algorithm
    parts = []
    if kl_loss_active(actor):
        parts.append(f"the KL loss (actor.use_kl_loss=True, {actor.kl_loss_type}, coef {actor.kl_loss_coef})")
    if algo.use_kl_in_reward:
        parts.append(f"the in-reward KL penalty (algorithm.use_kl_in_reward=True, {algo.kl_penalty})")
    return " and ".join(parts)


def _reference_consequence(a: PostTrainConfig, b: PostTrainConfig) -> list[str]:
    if uses_reference(a) == uses_reference(b):
        if uses_reference(a) and _kl_reason(a) != _kl_reason(b):
            return [f"both load a reference model: A for {_kl_reason(a)}, B for {_kl_reason(b)}"]
        return []
    if uses_reference(b):
        return [f"B adds a reference model for {_kl_reason(b)}: one more forward pass per step"]
    return [f"B drops the reference model that A loads for {_kl_reason(a)}"]


def _estimator_consequence(a: PostTrainConfig, b: PostTrainConfig) -> list[str]:
    ea, eb = a.algorithm.adv_estimator, b.algorithm.adv_estimator
    if ea == eb:
        return []
    return [f"advantages: A uses {ea}, {_summary(ea)}; B uses {eb}, {_summary(eb)}"]


def _loss_consequence(a: PostTrainConfig, b: PostTrainConfig) -> list[str]:
    la, lb = (c.actor_rollout_ref.actor.policy_loss.loss_mode for c in (a, b))
    if la == lb:
        return []
    from posttrain.algorithms import policy_loss_spec

    def summary(mode: str) -> str:
        try:
            return policy_loss_spec(mode).summary
        except ValueError:
            return "a registered policy loss"

    return [f"policy loss: A uses {la}, {summary(la)}; B uses {lb}, {summary(lb)}"]


def _rollout_consequences(a: PostTrainConfig, b: PostTrainConfig, fa: Flow, fb: Flow) -> list[str]:
    out = []
    if fa.n != fb.n:
        out.append(f"B samples {fb.n} response{'s' if fb.n != 1 else ''} per prompt (A: {fa.n}): {_ratio(fa.n, fb.n)} the rollout work per prompt"
                   + (f"; groups of {fb.n} for {b.algorithm.adv_estimator}"
                      if estimator_needs(b.algorithm.adv_estimator, "needs_groups") else ""))
    if fa.prompts_per_step != fb.prompts_per_step:
        out.append(f"B takes {fb.prompts_per_step} prompts per step (A: {fa.prompts_per_step})")
    if fa.responses_per_step != fb.responses_per_step:
        out.append(f"B generates {fb.responses_per_step} responses per step (A: {fa.responses_per_step}): "
                   f"{_ratio(fa.responses_per_step, fb.responses_per_step)}")
    if fa.response_length != fb.response_length:
        out.append(f"B allows responses of up to {fb.response_length} tokens (A: {fa.response_length}): longer rollouts, "
                   "and activation memory grows with length")
    ta, tb = fa.responses_per_step * fa.response_length, fb.responses_per_step * fb.response_length
    if ta != tb:
        out.append(f"B generates up to {tb:,} response tokens per step (A: {ta:,}): {_ratio(ta, tb)}")
    if (fa.rollout_engine, fa.rollout_workers) != (fb.rollout_engine, fb.rollout_workers):
        out.append(f"B's rollout: {rollout_description(fb)} (A: {rollout_description(fa)})")
    if fa.rollout_tp_requested != fb.rollout_tp_requested and "hf" not in (fa.rollout_engine, fb.rollout_engine):
        out.append(f"B requests rollout.tensor_model_parallel_size={fb.rollout_tp_requested} "
                   f"(A: {fa.rollout_tp_requested}), which changes nothing that runs: this build runs each "
                   f"{fb.rollout_engine} engine with TP {fb.rollout_tp} on every rank (one full copy of the weights "
                   "per rank) in both")
    ua = a.actor_rollout_ref.rollout.gpu_memory_utilization
    ub = b.actor_rollout_ref.rollout.gpu_memory_utilization
    if ua != ub:
        out.append(f"B gives the rollout engine {ub:.0%} of each GPU (A: {ua:.0%}) for weights and KV cache")
    return out


def _update_consequences(fa: Flow, fb: Flow) -> list[str]:
    out = []
    for role in ("actor", "critic"):
        ua, ub = getattr(fa, role), getattr(fb, role)
        if ua is None or ub is None:
            continue
        if ua.optimizer_steps != ub.optimizer_steps:
            out.append(f"{role}: B takes {ub.optimizer_steps} optimizer steps per training step (A: {ua.optimizer_steps})")
        if (ua.mini_batch_per_rank, ua.micro_batch) != (ub.mini_batch_per_rank, ub.micro_batch):
            out.append(f"{role}: B's mini-batch is {ub.mini_batch_per_rank} responses per rank in {ub.grad_accum} "
                       f"micro-batches of {ub.micro_batch} "
                       f"(A: {ua.mini_batch_per_rank} in {ua.grad_accum} of {ua.micro_batch})")
    if fa.total_steps != fb.total_steps and None not in (fa.total_steps, fb.total_steps):
        out.append(f"B runs {fb.total_steps} training steps (A: {fa.total_steps})")
    if fa.world_size != fb.world_size:
        out.append(f"B runs on {fb.world_size} GPUs (A: {fa.world_size})")
    return out


def consequences(a: PostTrainConfig, b: PostTrainConfig) -> list[str]:
    """What the key differences mean for the run."""
    out = (_estimator_consequence(a, b) + _loss_consequence(a, b) + _critic_consequence(a, b)
           + _reference_consequence(a, b))
    fa, fb = build_flow(a), build_flow(b)
    out += _rollout_consequences(a, b, fa, fb) + _update_consequences(fa, fb)
    lra, lrb = a.actor_rollout_ref.actor.optim.lr, b.actor_rollout_ref.actor.optim.lr
    if lra != lrb:
        out.append(f"B's actor learning rate is {lrb:g} (A: {lra:g}): {_ratio(lra, lrb)}")
    if _models(a) != _models(b):
        out.append(f"models loaded: A {_models(a)}; B {_models(b)}")
    return out


def compare(a: ConfigSource, b: ConfigSource, extra: tuple[str, ...] | list[str] = ()) -> ConfigDiff:
    """`extra`: command-line overrides applied to both sides (`posttrain compare A B key=value ...`)."""
    ca, cb = load_source(a, extra, validate=False), load_source(b, extra, validate=False)
    keys = diff_keys(ca, cb, explicit_keys(a), explicit_keys(b))
    uses = {"critic": (uses_critic(ca), uses_critic(cb)), "reference": (uses_reference(ca), uses_reference(cb))}
    return ConfigDiff(a.label, b.label, tuple(keys), tuple(consequences(ca, cb)), uses)


# ---- text ----

def _side(value: Any, where: Optional[str]) -> str:
    return show(value) + ("" if where else " (default)")


def _section_note(name: str, diff: ConfigDiff) -> str:
    if name in diff.uses:
        ua, ub = diff.uses[name]
        if ua != ub:
            return f"  ({'A' if ub else 'B'} has no {name}: its keys are unused there)"
        if not ua:
            return f"  (neither side uses a {name})"
    return ""


def render(diff: ConfigDiff) -> str:
    explicit = [d for d in diff.keys if d.follows is None]
    following = [d for d in diff.keys if d.follows is not None]
    lines = [f"A: {diff.a}", f"B: {diff.b}",
             f"{len(explicit)} keys differ" + (f" ({len(following)} more follow them)" if following else "")]
    for name, diffs in diff.by_section().items():
        shown = [d for d in diffs if d.follows is None]
        followers = [d for d in diffs if d.follows is not None]
        lines += ["", name + _section_note(name, diff)]
        for d in shown:
            lines.append(f"  {d.key}: {_side(d.a, d.a_set)} -> {_side(d.b, d.b_set)}")
            lines.append(f"      {d.doc}")
        for d in followers:
            lines.append(f"  {d.key}: {show(d.a)} -> {show(d.b)} (follows {d.follows})")
    lines += ["", "Consequences"]
    lines += [f"  - {c}" for c in diff.consequences] or ["  none derived"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="posttrain diff", description=__doc__.splitlines()[0])
    parser.add_argument("a", help="launch script, YAML config, key=value list (file or inline), or `defaults`")
    parser.add_argument("b", help="the same kinds as A")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    args = parser.parse_args(argv)
    try:
        result = compare(read_source(args.a), read_source(args.b))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.as_dict(), indent=2, default=str))
        return 0
    print(render(result))
    return 0
