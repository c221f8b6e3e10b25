"""`posttrain plan`: explain a run before it starts, without loading a model.

For a config (YAML, launch script, overrides; overrides alone apply to the built-in run, as for
`posttrain train`, and `posttrain plan defaults` plans verl's defaults) it prints the batch flow of
one training step, the models that will be loaded and why, a per-GPU memory estimate, and every
problem the config has.
`--json` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Optional

from posttrain.config import BUILTIN_CONFIG
from posttrain.config.load import ConfigError
from posttrain.config.schema import PostTrainConfig
from posttrain.config.scripts import (ConfigSource, ScriptOverride, explicit_keys, load_source, read_launch_script,
                                      read_source)
from posttrain.plan.checks import model_path_problems, plan_problems
from posttrain.plan.flow import Flow, build_flow, uses_models
from posttrain.plan.memory import MemoryEstimate, estimate_memory, parse_bytes
from posttrain.plan.reward import reward_plan
from posttrain.plan.model_dims import (
    ModelDims,
    dims_from_args,
    find_model_config,
    read_gguf_dims,
    read_model_config,
    value_model_dims,
)

__all__ = ["Plan", "build_plan", "main", "resolve_dims"]


@dataclass
class Plan:
    source: str
    flow: Flow
    models: list[dict[str, Any]]
    memory: Optional[MemoryEstimate]
    memory_skipped: Optional[str]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    reward: dict[str, Any] = field(default_factory=dict)
    """Where the reward comes from, its manager, judge and limits (`posttrain.plan.reward`)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "flow": self.flow.as_dict(),
            "models": self.models,
            "memory": self.memory.as_dict() if self.memory else {"skipped": self.memory_skipped},
            "reward": self.reward,
            "errors": self.errors,
            "warnings": self.warnings,
        }


def resolve_dims(config: PostTrainConfig, model_config: Optional[str] = None, **given) -> tuple[Optional[ModelDims], str]:
    """The actor model's shape: --model-config, else --params/--hidden/..., else the local config.json
    of actor_rollout_ref.model.path. Returns (dims or None, why when None)."""
    given = {k: v for k, v in given.items() if v is not None}
    if model_config:
        dims = read_model_config(model_config)
        if "params" in given:
            dims = ModelDims(**{**dims.as_dict(), "params": given["params"],
                                "source": dims.source + " (params from --params)"})
        return dims, ""
    if given:
        dims = dims_from_args(**{"params": None, **given})
        if dims.params is None:
            return None, "pass --params, or --hidden and --layers, to estimate memory"
        return dims, ""
    path = config.actor_rollout_ref.model.path
    found = find_model_config(path)
    if found is not None:
        return read_model_config(found), ""
    try:
        dims = read_gguf_dims(path)
    except (OSError, ValueError) as err:  # an unreadable or non-Llama GGUF: say so, plan the rest
        return None, f"the model's shape is unknown: {err}; pass --model-config PATH, or --params ..."
    if dims is not None:
        return dims, ""
    return None, (f"the model's shape is unknown: {path} is not a local folder with config.json, a readable .gguf "
                  "file (nor in the local Hugging Face cache); pass --model-config PATH, or --params 7e9 --hidden 4096 "
                  "--layers 32 ...")


def _critic_dims(config: PostTrainConfig, actor_dims: ModelDims) -> ModelDims:
    path = config.critic.model.path
    if path != config.actor_rollout_ref.model.path:
        found = find_model_config(path)
        if found is not None:
            return value_model_dims(read_model_config(found))
    return value_model_dims(actor_dims)


def cpu_terms(config: PostTrainConfig):
    """The CPU run's terms (`posttrain.plan.memory.CpuTerms`) when the run computes on a CPU: trainer.device=cpu,
    or auto in one process on a machine without CUDA (the built-in runs on a laptop); else None: GPU terms, also
    for a multi-rank script planned on a machine without GPUs (planning for the cluster it will run on)."""
    from posttrain.models.compute_dtype import cpu_bf16_support
    from posttrain.plan.memory import CpuTerms

    t = config.trainer
    device = t.device
    if device == "cuda" or (device == "auto" and (_cuda_visible() or t.nnodes * t.n_gpus_per_node > 1)):
        return None
    return CpuTerms.of(config, cpu_bf16_support()[0])


def _cuda_visible() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def threads_per_process(processes: int) -> int:
    """torch's threads in each of ``processes`` on this machine: OMP_NUM_THREADS when set, else this process's
    cores shared out (one process: all of them, torch's default)."""
    import os

    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, processes))


def cpu_ram_bytes() -> Optional[float]:
    from posttrain.host.memory_plan import machine_ram

    total = machine_ram()[0]
    return None if total is None else total * 2**30


def build_plan(config: PostTrainConfig, *, source: str = "", dims: Optional[ModelDims] = None, dims_reason: str = "",
               gpu_memory: Optional[float] = None, train_size: Optional[int] = None,
               mean_tokens: Optional[int] = None, set_keys: Optional[Collection[str]] = None) -> Plan:
    """Everything `posttrain plan` reports, for a config loaded with validate=False. ``set_keys``: the keys the
    user set (`set_keys_of`), so a warning about a key never blames them for one a base config sets."""
    from posttrain.config.validate import find_problems

    cpu = None if gpu_memory else cpu_terms(config)  # --gpu-memory: the user plans for a GPU
    flow = build_flow(config, train_size)
    if cpu is not None:  # placed in the machine's terms: processes and threads, not "1 node x 1 GPUs"
        flow = dataclasses.replace(flow, cpu_threads=threads_per_process(flow.world_size))
    errors, warnings = find_problems(config, set_keys)
    more_errors, more_warnings = plan_problems(config, flow, dims, set_keys)
    memory, skipped = None, None
    if dims is None or dims.params is None:
        skipped = dims_reason or "the model's size is unknown"
    else:
        budget = gpu_memory or (cpu_ram_bytes() if cpu else None) or parse_bytes("80GiB")
        memory = estimate_memory(config, flow, dims, budget, mean_tokens, _critic_dims(config, dims), cpu=cpu)
    reward = reward_plan(config)
    more_errors += [reward["problem"]] if "problem" in reward else []
    models = uses_models(config)
    more_errors += model_path_problems(config, models)
    return Plan(source, flow, models, memory, skipped, errors + more_errors, warnings + more_warnings, reward)


def _parser() -> argparse.ArgumentParser:
    from posttrain.cli_args import file_to_read, memory_size, positive_float, positive_int, yaml_config_file

    p = argparse.ArgumentParser(prog="posttrain plan", description=__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="*", help="a launch script or YAML file (or `defaults`: verl's), then key=value "
                   "overrides; with no script or file, the built-in run that `posttrain train` runs")
    p.add_argument("--config", type=yaml_config_file, help="YAML config layered over the defaults")
    p.add_argument("--script", type=file_to_read("a launch script"),
                   help="launch script whose key=value arguments are applied (after --config)")
    p.add_argument("--model-config", help="model folder or config.json (default: actor_rollout_ref.model.path)")
    g = p.add_argument_group("model shape when no config.json is at hand")
    g.add_argument("--params", type=positive_float, help="parameter count, e.g. 7e9")
    for name in ("hidden", "layers", "heads", "kv-heads", "vocab", "intermediate"):
        g.add_argument(f"--{name}", type=positive_int)
    p.add_argument("--gpu-memory", type=memory_size, default=None,
                   help="memory of one GPU (default 80GiB; on a CPU run: this machine's RAM)")
    p.add_argument("--train-size", type=positive_int, help="training prompts (default: counted from data.train_files)")
    p.add_argument("--mean-tokens", type=positive_int,
                   help="typical prompt+response tokens (default: the maximum, worst case)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _source(args: argparse.Namespace) -> tuple[ConfigSource, list[str]]:
    """The config source (YAML and/or script) and the command-line overrides."""
    yaml_path = Path(args.config) if args.config else None
    script: list[ScriptOverride] = list(read_launch_script(args.script)) if args.script else []
    labels = [x for x in (args.config, args.script) if x]
    overrides = []
    for item in args.inputs:
        if "=" in item:
            overrides.append(item)
            continue
        src = read_source(item)
        if src.kind == "yaml":
            yaml_path = src.yaml_path
        elif src.kind != "defaults":
            script += list(src.overrides)
        labels.append(item)
    if yaml_path is not None and (yaml_path.is_dir() or not yaml_path.exists()):
        found = "is a folder, not a YAML file" if yaml_path.is_dir() else "does not exist"
        raise ConfigError(f"config file {yaml_path} {found}; give a YAML file of config keys")
    base = None
    if not labels:  # overrides alone land where `posttrain train`'s do: on the built-in run
        base, labels = BUILTIN_CONFIG, ["the built-in run (posttrain train)"]
    label = " + ".join(labels + ([f"{len(overrides)} overrides"] if overrides else []))
    return ConfigSource(label, "plan", yaml_path=yaml_path, overrides=tuple(script), base=base), overrides


def set_keys_of(source: ConfigSource, overrides: list[str]) -> set[str]:
    """The keys the user set: the source's own (YAML, script; not its base's) and the command line's."""
    given = tuple(ScriptOverride(item, 0) for item in overrides)
    return set(explicit_keys(dataclasses.replace(source, overrides=source.overrides + given)))


def main(argv: list[str] | None = None) -> int:
    from posttrain.plan.report import render

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("sft", "dpo"):  # the SFT / DPO trainers' own tree
        from posttrain.plan.sft import main as plan_sft

        return plan_sft(argv)
    args = _parser().parse_args(argv)
    try:
        source, overrides = _source(args)
        config = load_source(source, overrides, validate=False)
        dims, why = resolve_dims(config, args.model_config, params=args.params, hidden=args.hidden, layers=args.layers,
                                 heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab, intermediate=args.intermediate)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    plan = build_plan(config, source=source.label, dims=dims, dims_reason=why, gpu_memory=args.gpu_memory,
                      train_size=args.train_size, mean_tokens=args.mean_tokens, set_keys=set_keys_of(source, overrides))
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        print(render(plan))
    return 1 if plan.errors else 0
