"""The shape of a model, read from its `config.json` (a GGUF's: its plain copy's, else its header)
or given on the command line; never loaded.

Only the numbers the memory estimate needs: parameter count, hidden size, layers, attention and
key/value heads, vocabulary, MLP width. Missing ones are filled with stated assumptions.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from posttrain.errors import ConfigError
from posttrain.models.model_path import SMOLLM2_ALIAS, ResolvedModel, gguf_cache_folder, gguf_hf_config, smollm2_gguf

MAX_DIMENSION = 2**24
"""The largest width, depth, head or vocabulary count read (16,777,216; published models stay under 2**18):
a larger one is a typo (``1e308``) whose products overflow the estimate."""
MAX_POSITIONS = 2**32
"""The largest ``max_position_embeddings`` read (context lengths reach 2**24 today)."""


@dataclass(frozen=True)
class ModelDims:
    params: Optional[float]
    """Total parameters (embeddings and LM head included)."""
    hidden: Optional[int] = None
    """hidden_size."""
    layers: Optional[int] = None
    """num_hidden_layers."""
    heads: Optional[int] = None
    """num_attention_heads."""
    kv_heads: Optional[int] = None
    """num_key_value_heads (fewer than heads with grouped-query attention)."""
    head_dim: Optional[int] = None
    """Width of one attention head (hidden / heads unless the config says otherwise)."""
    vocab: Optional[int] = None
    """vocab_size."""
    intermediate: Optional[int] = None
    """MLP width (intermediate_size)."""
    tied_embeddings: bool = False
    """The LM head shares the embedding matrix."""
    max_positions: Optional[int] = None
    """max_position_embeddings."""
    source: str = ""
    """Where the numbers came from."""
    assumptions: tuple[str, ...] = field(default_factory=tuple)
    """Numbers that were not given and were assumed."""

    @property
    def has_shape(self) -> bool:
        """Enough to estimate activations and the KV cache."""
        return self.hidden is not None and self.layers is not None

    @property
    def params_per_layer(self) -> float:
        """One decoder layer: attention (q, k, v, o), gated MLP (gate, up, down), two norms."""
        h, hd = self.hidden, self.head_dim
        attn = h * self.heads * hd * 2 + h * self.kv_heads * hd * 2
        return attn + 3 * h * self.intermediate + 2 * h

    @property
    def embedding_params(self) -> float:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def as_dict(self) -> dict:
        return asdict(self)


def params_from_shape(dims: ModelDims) -> float:
    """Parameter count of a Llama-style decoder: layers x per-layer + embeddings (+ LM head) + final norm."""
    return dims.layers * dims.params_per_layer + dims.embedding_params + dims.hidden


def complete(dims: ModelDims) -> ModelDims:
    """Fill what a shape needs (heads, kv heads, head dim, vocab, MLP width) with Llama's conventions,
    recording each assumption; compute params from the shape when not given."""
    if not dims.has_shape:
        return dims
    notes = list(dims.assumptions)
    h = dims.hidden
    heads = dims.heads
    if heads is None:
        heads = max(1, h // 128)
        notes.append(f"heads not given: assumed hidden/128 = {heads}")
    kv_heads = dims.kv_heads
    if kv_heads is None:
        kv_heads = heads
        notes.append(f"kv heads not given: assumed = heads ({heads}, no grouped-query attention)")
    head_dim = dims.head_dim or h // heads
    vocab = dims.vocab
    if vocab is None:
        vocab = 32000
        notes.append("vocab not given: assumed 32000 (Llama-2)")
    inter = dims.intermediate
    if inter is None:
        inter = 256 * math.ceil(8 * h / 3 / 256)
        notes.append(f"intermediate size not given: assumed 8/3 x hidden rounded up to 256 = {inter} (Llama)")
    out = ModelDims(dims.params, h, dims.layers, heads, kv_heads, head_dim, vocab, inter, dims.tied_embeddings,
                    dims.max_positions, dims.source, tuple(notes))
    if out.params is None:
        return ModelDims(**{**asdict(out), "params": params_from_shape(out), "assumptions": tuple(notes)})
    return out


def dims_from_hf_config(cfg: dict, source: str) -> ModelDims:
    """ModelDims from a Hugging Face `config.json` dict (Llama, Qwen, Mistral, DeepSeek, GPT-2 names)."""
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers keep the language model here
        cfg = {**cfg, **cfg["text_config"]}

    def pick(*names):
        name = next((n for n in names if cfg.get(n) is not None), None)
        if name is None:
            return None
        return checked_dimension(name, cfg[name], source, MAX_POSITIONS if "position" in name else MAX_DIMENSION)

    dims = ModelDims(
        params=None,
        hidden=pick("hidden_size", "n_embd", "d_model"),
        layers=pick("num_hidden_layers", "n_layer", "num_layers"),
        heads=pick("num_attention_heads", "n_head"),
        kv_heads=pick("num_key_value_heads", "num_attention_heads", "n_head"),
        head_dim=pick("head_dim"),
        vocab=pick("vocab_size"),
        intermediate=pick("intermediate_size", "n_inner", "ffn_dim"),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_positions=pick("max_position_embeddings", "n_positions"),
        source=source,
    )
    return complete(dims)


def checked_dimension(name: str, value: object, where: str, limit: int = MAX_DIMENSION) -> int:
    """``value`` as a model dimension: a whole number from 1 to ``limit``; a `ConfigError` naming ``where``
    (the file; "" for a flag) and ``name`` (the key or the flag) otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= limit:
        return value
    raise ConfigError(f"{where + ': ' if where else ''}{name}={value!r} is not a model dimension: it must be a whole number from 1 to "
                      f"{limit:,}")


def read_model_config(path: str | Path) -> ModelDims:
    """From a model folder holding config.json, or a config.json file itself."""
    path = Path(path).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        from posttrain.checkpoint.found import checkpoint_found

        found = checkpoint_found(path) if path.is_dir() else None
        raise FileNotFoundError(found or f"{file} does not exist")
    return dims_from_hf_config(_read_json_config(file), str(file))


def _read_json_config(file: Path) -> dict:
    """A Hugging Face config.json's settings; a `ConfigError` naming the file when it is not a JSON object
    in text (a weights file given by mistake)."""
    expected = "give a model folder or its config.json"
    try:
        text = file.read_bytes().decode("utf-8")
    except OSError as err:
        raise ConfigError(f"{file}: cannot read it ({err.strerror or err}); {expected}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{file} is not a JSON/YAML text config (it holds binary data); {expected}") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{file}:{err.lineno}: not a JSON config ({err.msg}); {expected}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{file} holds a JSON {type(cfg).__name__}, not the object of a model's settings; {expected}")
    return cfg


def find_model_config(model_path: str) -> Optional[Path]:
    """config.json of a local folder, of a GGUF's (or the SmolLM2 alias's) plain copy in posttrain's
    cache, or of a hub id already in the local Hugging Face cache (nothing is downloaded)."""
    local = Path(model_path).expanduser()
    if (local / "config.json").is_file():
        return local / "config.json"
    gguf = _gguf_file(model_path)
    if gguf is not None:
        where = ResolvedModel(str(gguf.parent), gguf.name)
        converted = gguf_cache_folder(where) / "config.json"
        return converted if converted.is_file() else None
    if local.suffix.lower() == ".gguf" or model_path.count("/") != 1 or model_path.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model_path, "config.json")
    except Exception:  # noqa: BLE001 - a missing or odd cache only means "not at hand"
        return None
    return Path(cached) if isinstance(cached, str) else None


def _gguf_file(model_path: str) -> Optional[Path]:
    """The GGUF file a model path names (a ``.gguf`` path or the SmolLM2 alias), or None."""
    if model_path.lower() == SMOLLM2_ALIAS:
        try:
            return smollm2_gguf()
        except FileNotFoundError:
            return None
    local = Path(model_path).expanduser()
    return local if local.suffix.lower() == ".gguf" and local.is_file() else None


def read_gguf_dims(model_path: str) -> Optional[ModelDims]:
    """The shape from the header of the GGUF a model path names (before its first run has made the
    plain copy), or None when the path names no GGUF or the ``gguf`` package is missing."""
    gguf = _gguf_file(model_path)
    if gguf is None or importlib.util.find_spec("gguf") is None:
        return None
    return dims_from_hf_config(gguf_hf_config(gguf), f"{gguf} (its header)")


def dims_from_args(params: Optional[float], hidden=None, layers=None, heads=None, kv_heads=None, vocab=None,
                   intermediate=None) -> ModelDims:
    """ModelDims from `--params/--hidden/--layers/...`; the given parameter count wins over the shape's."""
    given = {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads, "vocab": vocab,
             "intermediate": intermediate}
    sizes = {k: None if v is None else checked_dimension(f"--{k.replace('_', '-')}", v, "")
             for k, v in given.items()}
    return complete(ModelDims(params, head_dim=None, source="command line", **sizes))


def value_model_dims(dims: ModelDims) -> ModelDims:
    """The critic built from a causal LM: the LM head (vocab x hidden) becomes a value head (hidden x 1)."""
    if dims.params is None or not dims.has_shape:
        return dims
    head = 0 if dims.tied_embeddings else dims.vocab * dims.hidden
    note = "critic: the actor's model with a value head in place of the LM head"
    return ModelDims(**{**asdict(dims), "params": dims.params - head + dims.hidden,
                        "assumptions": dims.assumptions + (note,)})
