"""LoRA through ``peft``: adapters on a frozen base model, with verl's keys and semantics.

Keys (verl 0.9, ``verl/workers/fsdp_workers.py``): ``actor_rollout_ref.model.lora_rank`` (> 0 turns
LoRA on), ``lora_alpha``, ``target_modules`` (``all-linear`` or a list of module names; a string
other than ``all-linear`` is a regular expression matched against full module names, as peft does),
``exclude_modules``, ``lora_adapter_path`` (start from a saved peft adapter folder: its own rank,
alpha and targets then apply, as ``PeftModel.from_pretrained(..., is_trainable=True)`` in verl), and
``critic.model.lora_rank`` / ``lora_alpha`` / ``target_modules``. verl builds
``LoraConfig(r, lora_alpha, target_modules, exclude_modules, bias="none")`` and ``get_peft_model``;
so do we (no dropout: peft's default 0, as verl).

How the rest of posttrain sees a LoRA model. peft injects its layers *in place*: every targeted
``nn.Linear`` becomes a ``lora.Linear`` holding the original layer (``base_layer``, frozen) and the
adapter matrices ``lora_A`` / ``lora_B`` (trainable). The workers keep using the injected Hugging
Face model itself (``LoraAdapter.model``: same class, same ``base_model`` / ``lm_head``), so the
log-prob code, the rollout engines and FSDP2 need no special path; the ``PeftModel`` wrapper is kept
beside it for what peft does best: ``disable_adapter()`` (the reference policy is the actor with its
adapters disabled, verl's "ref in actor") and the adapter's config for ``save_pretrained`` folders.

Only ``nn.Linear`` targets are accepted (peft also adapts embeddings and convolutions, whose merged
weights the vLLM push and the export would need other formulas for).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from posttrain.peft_folder import adapter_folder_problem  # re-exported
from posttrain.errors import CheckpointError, ConfigError

__all__ = [
    "ADAPTER_DIR",
    "BASE_FILE",
    "LoraAdapter",
    "LoraSettings",
    "adapter_folder_problem",
    "meta_model",
    "apply_lora",
    "base_digest",
    "check_lora_targets",
    "has_lora",
    "lora_settings",
    "MergedWeights",
    "merged_for_generation",
    "merged_named_tensors",
    "unmerged_base_names",
]

ADAPTER_DIR = "lora_adapter"
"""A role folder's peft adapter (``adapter_config.json`` + ``adapter_model.safetensors``; verl's name)."""
BASE_FILE = "lora_base.json"
"""The base model an adapter was trained on: its path, master dtype and a digest of its weights."""
ALL_LINEAR = "all-linear"
_ADAPTER_NAME = "default"  # peft's name for the one adapter a model carries


@dataclass(frozen=True)
class LoraSettings:
    """One role's LoRA keys, read from its ``model`` config section."""

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...]
    exclude_modules: str | tuple[str, ...] | None
    adapter_path: str | None
    section: str
    """The config section the keys live in (``actor_rollout_ref.model``, ``critic.model``), named in errors."""

    def as_dict(self) -> dict[str, Any]:
        """The settings a checkpoint must have been trained with (the resume fingerprint)."""
        return {"lora_rank": self.rank, "lora_alpha": self.alpha, "target_modules": _jsonable(self.target_modules),
                "exclude_modules": _jsonable(self.exclude_modules), "lora_adapter_path": self.adapter_path}


def _names(value: Any) -> str | tuple[str, ...] | None:
    """A module-name key as peft takes it: None, a string (regex or ``all-linear``) or a tuple of names."""
    if value is None or isinstance(value, str):
        return value
    return tuple(str(v) for v in value)


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def lora_settings(model_config: Any, section: str) -> LoraSettings | None:
    """The role's LoRA settings, or None for full fine-tuning. As verl: LoRA is on when ``lora_rank > 0``
    or ``lora_adapter_path`` is set."""
    rank = int(getattr(model_config, "lora_rank", 0) or 0)
    path = getattr(model_config, "lora_adapter_path", None)
    if rank <= 0 and not path:
        return None
    return LoraSettings(rank=rank, alpha=float(getattr(model_config, "lora_alpha", 16)),
                        target_modules=_names(getattr(model_config, "target_modules", ALL_LINEAR)),
                        exclude_modules=_names(getattr(model_config, "exclude_modules", None)),
                        adapter_path=os.path.expanduser(str(path)) if path else None, section=section)


# --------------------------------------------------------------------------- checks (start-up)
def _linear_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name]


def _leaf_names(names: list[str]) -> list[str]:
    return sorted({n.rsplit(".", 1)[-1] for n in names})


def _matches(pattern: str | tuple[str, ...], name: str) -> bool:
    """peft's rule: a string is a regex on the full name; a list entry equals the name or its last parts."""
    if isinstance(pattern, str):
        return re.fullmatch(pattern, name) is not None
    return any(name == p or name.endswith("." + p) for p in pattern)


def _unmatched(pattern: str | tuple[str, ...], names: list[str]) -> list[str]:
    """The entries of ``pattern`` that name no module of ``names`` (the whole regex when it matches none)."""
    if isinstance(pattern, str):
        return [] if any(_matches(pattern, n) for n in names) else [pattern]
    return [p for p in pattern if not any(_matches((p,), n) for n in names)]


def check_lora_targets(model: nn.Module, settings: LoraSettings, head: nn.Module | None = None) -> None:
    """``target_modules`` / ``exclude_modules`` name modules of ``model``, all of them ``nn.Linear``;
    a `ConfigError` naming the key and listing valid names otherwise. ``head``: the output layer,
    which ``all-linear`` leaves out (as peft does)."""
    if settings.adapter_path:
        return  # the adapter folder's own targets apply; peft checks them against the model
    linear = _linear_names(model)
    modules = [name for name, _ in model.named_modules() if name]
    valid = ", ".join([ALL_LINEAR, *_leaf_names(linear)][:16])
    key = f"{settings.section}.target_modules"
    targets = settings.target_modules
    if targets != ALL_LINEAR:
        missing = _unmatched(targets, modules)
        if missing:
            raise ConfigError(f"{key}={_jsonable(targets)!r}: {', '.join(map(repr, missing))} matches no module of "
                              f"{type(model).__name__}; valid names include: {valid}")
        not_linear = [n for n in modules if _matches(targets, n) and n not in linear]
        if not_linear:
            kind = type(model.get_submodule(not_linear[0])).__name__
            raise ConfigError(f"{key}={_jsonable(targets)!r} selects {not_linear[0]} ({kind}); posttrain's LoRA adapts "
                              f"nn.Linear layers only: {valid}")
    elif not [n for n in linear if head is None or model.get_submodule(n) is not head]:
        raise ConfigError(f"{key}={ALL_LINEAR}: {type(model).__name__} has no nn.Linear layer to adapt")
    if settings.exclude_modules is not None:
        missing = _unmatched(settings.exclude_modules, modules)
        if missing:
            raise ConfigError(f"{settings.section}.exclude_modules={_jsonable(settings.exclude_modules)!r}: "
                              f"{', '.join(map(repr, missing))} matches no module of {type(model).__name__} "
                              f"(a typo would silently adapt it); valid names include: {valid}")


def meta_model(model_config: Any) -> nn.Module:
    """The model's module tree on the meta device: names and layer types, no memory, no weights."""
    from transformers import AutoModelForCausalLM

    from posttrain.models.loading import load_config

    hf_config = load_config(model_config.path, trust_remote_code=model_config.trust_remote_code,
                            override_config=model_config.override_config)
    if hasattr(hf_config, "quantization_config"):  # a GGUF's: not needed for the structure
        del hf_config.quantization_config
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=model_config.trust_remote_code)


# --------------------------------------------------------------------------- the base model's identity
def base_digest(module: nn.Module) -> dict[str, float]:
    """A fingerprint of the (unsharded) base weights: parameter count, and float64 sum and sum of squares.

    An adapter is only meaningful on the weights it was trained on; a checkpoint holds the adapter
    alone, so a resume (or an export) whose base model differs is refused by comparing digests.
    """
    total = squares = 0.0
    count = 0
    with torch.no_grad():
        for _, p in module.named_parameters():
            t = p.detach().to(torch.float64)
            total += float(t.sum())
            squares += float((t * t).sum())
            count += p.numel()
    return {"numel": count, "sum": total, "sum_of_squares": squares}


def same_digest(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.get("numel") == b.get("numel") and all(
        math.isclose(a.get(k, math.nan), b.get(k, math.nan), rel_tol=1e-9, abs_tol=1e-9) for k in ("sum", "sum_of_squares"))


# --------------------------------------------------------------------------- applying adapters
def apply_lora(model: nn.Module, settings: LoraSettings, *, model_path: str | None = None,
               model_dtype: str = "fp32", causal_lm: bool = True, seed: int = 0) -> "LoraAdapter":
    """Inject LoRA adapters into ``model`` in place (base frozen, adapters trainable); returns the
    `LoraAdapter` whose ``model`` is ``model`` itself. ``causal_lm``: ``model`` is a causal LM (the
    actor); else a backbone (the critic's, whose value head stays outside peft and trainable, as
    verl's TOKEN_CLS critic keeps its score head in ``modules_to_save``).

    ``seed``: the random ``lora_A`` matrices are drawn from it, not from the global RNG, so every
    rank builds the same adapters (ranks seed their global RNGs differently, and FSDP assumes one
    model) and a run's adapters do not depend on what drew random numbers before.
    """
    from peft import LoraConfig, PeftModel, TaskType, get_peft_model

    head = model.get_output_embeddings() if causal_lm and hasattr(model, "get_output_embeddings") else None
    check_lora_targets(model, settings, head)
    digest = base_digest(model)
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with warnings.catch_warnings(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # peft asks transformers 5
        if settings.adapter_path:
            peft_model = _from_adapter_folder(model, settings)
        else:
            config = LoraConfig(task_type=TaskType.CAUSAL_LM if causal_lm else None, r=settings.rank,
                                lora_alpha=settings.alpha, target_modules=_peft_names(settings.target_modules),
                                exclude_modules=_peft_names(settings.exclude_modules), bias="none")
            peft_model = get_peft_model(model, config)
    assert isinstance(peft_model, PeftModel) and peft_model.get_base_model() is model
    return LoraAdapter(peft_model, settings, digest, model_path=_recorded_path(model_path), model_dtype=model_dtype)


def _recorded_path(path: str | None) -> str | None:
    """A local model path made absolute (an export may run from another folder); aliases and hub ids as given."""
    if path is None:
        return None
    local = Path(os.path.expanduser(str(path)))
    return str(local.resolve()) if local.exists() else str(path)


def _peft_names(value: str | tuple[str, ...] | None) -> str | list[str] | None:
    return list(value) if isinstance(value, tuple) else value


def _from_adapter_folder(model: nn.Module, settings: LoraSettings):
    from peft import PeftModel

    from posttrain.models.loading import weights_only

    key = f"{settings.section}.lora_adapter_path={settings.adapter_path}"
    problem = adapter_folder_problem(settings.adapter_path)
    if problem:
        raise ConfigError(f"{key}: {problem}")
    with weights_only(settings.adapter_path):  # outside the try: its one line is not "does not fit"
        try:
            peft_model = PeftModel.from_pretrained(model, settings.adapter_path, is_trainable=True)
        except (ValueError, KeyError, RuntimeError, OSError) as err:
            raise ConfigError(f"{key}: the adapter does not fit this model ({str(err).splitlines()[0]})") from err
    config = peft_model.peft_config[_ADAPTER_NAME]
    if getattr(config, "use_dora", False):
        raise ConfigError(f"{key}: DoRA adapters are not supported (their merged weights need the DoRA magnitudes)")
    bad = [n for n, m in model.named_modules() if _is_lora_layer(m) and not isinstance(m.get_base_layer(), nn.Linear)]
    if bad:
        raise ConfigError(f"{key}: the adapter adapts {bad[0]}, which is not an nn.Linear layer; posttrain's LoRA "
                          "adapts nn.Linear layers only")
    return peft_model


def _is_lora_layer(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def has_lora(module: nn.Module) -> bool:
    """Whether ``module`` carries peft LoRA layers (without importing peft when it never did)."""
    import sys

    return "peft" in sys.modules and any(_is_lora_layer(m) for m in module.modules())


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP2-sharded) parameter: a collective for DTensors."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


class LoraAdapter:
    """A model's LoRA adapters: the injected model, peft's wrapper, and what a checkpoint records.

    Args:
        peft_model: the ``PeftModel`` around the injected model.
        settings: the keys it was built from.
        digest: `base_digest` of the base weights, taken before the adapters were added.
        model_path: the base model's path (recorded so an export can rebuild the base).
        model_dtype: the base's master dtype (``fsdp_config.model_dtype``), for the same reason.
    """

    def __init__(self, peft_model: Any, settings: LoraSettings, digest: dict[str, float], *,
                 model_path: str | None = None, model_dtype: str = "fp32"):
        self.peft = peft_model
        self.settings, self.digest = settings, digest
        self.model_path, self.model_dtype = model_path, model_dtype

    @property
    def model(self) -> nn.Module:
        """The injected model (a causal LM or a backbone) that the worker trains and runs."""
        return self.peft.get_base_model()

    @property
    def config(self) -> Any:
        """peft's ``LoraConfig`` of the adapter (rank, alpha, resolved target modules)."""
        return self.peft.peft_config[_ADAPTER_NAME]

    def disabled(self) -> contextlib.AbstractContextManager:
        """Adapters off for the ``with`` block: the model computes as its frozen base (peft's
        ``disable_adapter()``; under FSDP the adapter shards are gathered but unused)."""
        return self.peft.disable_adapter()

    # ---------------------------------------------------------------- checkpoint files
    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter weights in peft's file layout (``base_model.model.<module>.lora_A.weight``), full
        tensors on CPU. A collective under FSDP: every rank calls it (the same order everywhere)."""
        from peft.utils import get_peft_model_state_dict

        state = {name: _full(p).cpu().clone() for name, p in self.peft.named_parameters()
                 if ".lora_" in name}
        return get_peft_model_state_dict(self.peft, state_dict=state, save_embedding_layers=False)

    def write(self, folder: str | os.PathLike, rank: int = 0) -> None:
        """``folder/lora_adapter/`` (a peft folder ``PeftModel.from_pretrained`` loads) and
        ``folder/lora_base.json``; gathers on every rank, writes on rank 0."""
        from safetensors.torch import save_file

        state = self.adapter_state()
        if rank != 0:
            return
        out = Path(folder) / ADAPTER_DIR
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, out / "adapter_model.safetensors",
                  metadata={"format": "pt"})
        config = copy.deepcopy(self.config)
        config.base_model_name_or_path = self.model_path
        config.inference_mode = True
        config.save_pretrained(str(out))
        self.write_base_record(folder, rank)

    def write_base_record(self, folder: str | os.PathLike, rank: int = 0) -> None:
        """``folder/lora_base.json``: the base model's path, master dtype and digest (rank 0 writes)."""
        if rank != 0:
            return
        base = {"model_path": self.model_path, "model_dtype": self.model_dtype, "digest": self.digest,
                "lora": self.settings.as_dict()}
        (Path(folder) / BASE_FILE).write_text(json.dumps(base, indent=1))

    def check_base(self, folder: str | os.PathLike) -> None:
        """Refuse a role folder whose adapter was trained on other base weights than this model's."""
        saved = read_base_record(folder)
        if not same_digest(saved.get("digest", {}), self.digest):
            raise CheckpointError(
                f"{folder} holds LoRA adapters trained on other base weights ({saved.get('model_path')}, digest "
                f"{saved.get('digest')}) than this run's {self.settings.section}.path={self.model_path} (digest "
                f"{self.digest}); resume with the base model the adapters were trained on")


def read_base_record(folder: str | os.PathLike) -> dict[str, Any]:
    """``lora_base.json`` of a LoRA role folder; `CheckpointError` when it is missing or unreadable."""
    path = Path(folder) / BASE_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is missing or unreadable ({err}): the folder holds no LoRA adapter "
                              "record (saved by a full fine-tuning run?)") from err
    if not isinstance(record, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return record


# --------------------------------------------------------------------------- merged weights (vLLM push)
def _lora_delta(layer: nn.Module) -> torch.Tensor:
    """``scaling * B @ A`` of a peft ``lora.Linear`` (full tensors; transposed for fan_in_fan_out)."""
    a = _full(layer.lora_A[_ADAPTER_NAME].weight)
    b = _full(layer.lora_B[_ADAPTER_NAME].weight)
    delta = (b.float() @ a.float()) * layer.scaling[_ADAPTER_NAME]
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


def _base_name(name: str) -> str:
    return name.replace(".base_layer.", ".")


def unmerged_base_names(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(base name, parameter)`` of every non-adapter parameter, tied twins included: the names and
    shapes of the model without LoRA (what an inference engine holds)."""
    for name, p in module.named_parameters(remove_duplicate=False):
        if ".lora_" not in name:
            yield _base_name(name), p


def merged_named_tensors(module: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights with each adapter merged (``W + scaling * B @ A``, computed in float32) under
    the base model's names, one full tensor at a time: what an engine without LoRA support loads
    (verl's path when vLLM's own LoRA mode is off). FSDP2 shards are gathered when reached, in
    ``named_parameters`` order, the same on every rank."""
    layers = {name: m for name, m in module.named_modules() if _is_lora_layer(m)}
    for name, p in module.named_parameters(remove_duplicate=False):
        if ".lora_" in name:
            continue
        full = _full(p)
        owner = name[:-len(".base_layer.weight")] if name.endswith(".base_layer.weight") else None
        if owner in layers:
            full = (full.float() + _lora_delta(layers[owner])).to(full.dtype)
        yield _base_name(name), full if dtype is None or not full.is_floating_point() else full.to(dtype)


# --------------------------------------------------------------------------- merged weights (hf decoding)
class MergedWeights:
    """What `merged_for_generation` swapped in: ``refresh()`` recomputes ``W + scaling * B @ A`` in place after
    the adapters changed inside the block (a weight push that lands mid-generation: partial rollouts)."""

    def __init__(self, swapped: list[tuple[nn.Module, torch.Tensor]]):
        self.swapped = swapped

    @torch.no_grad()
    def refresh(self) -> None:
        for layer, base in self.swapped:
            merged = layer.base_layer._parameters["weight"]
            merged.copy_((base.float() + _lora_delta(layer)).to(merged.dtype))


@contextlib.contextmanager
def merged_for_generation(module: nn.Module, dtype: torch.dtype | None = None) -> Iterator["MergedWeights"]:
    """Within the block, every LoRA layer of ``module`` computes one product with ``W + scaling * B @ A``
    (held in ``dtype``, the compute precision, so bf16 autocast need not cast it at every step) instead
    of the base product plus the two adapter products: unmerged adapters made generation much slower
    than full fine-tuning's (``benchmarks/bench_step.py --lora 32``; benchmarks/README.md, "LoRA").

    The base layer's own parameter object is set aside and put back, never written: the frozen base
    stays bit-identical. Layers whose base weight is shared with another module (a tied ``lm_head``)
    keep the adapter path, as do FSDP2-sharded modules (their weights are not full tensors here).
    """
    from torch.distributed.tensor import DTensor

    tied = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    layers = [m for m in module.modules() if _is_lora_layer(m) and not m.merged and not m.disable_adapters
              and isinstance(m.base_layer, nn.Linear) and id(m.base_layer.weight) not in tied
              and not isinstance(m.base_layer.weight, DTensor)]
    swapped = []
    try:
        with torch.no_grad():
            for layer in layers:
                base = layer.base_layer.weight
                merged = base.float() + _lora_delta(layer)
                merged = nn.Parameter(merged.to(dtype or base.dtype), requires_grad=False)
                layer.base_layer._parameters["weight"] = merged
                layer.merged_adapters = [_ADAPTER_NAME]
                swapped.append((layer, base))
        yield MergedWeights(swapped)
    finally:
        for layer, base in swapped:
            layer.base_layer._parameters["weight"] = base
            layer.merged_adapters = []
