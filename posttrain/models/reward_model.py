"""A learned reward model: a sequence-classification checkpoint with one label, frozen, read at the
last valid token of each row.

verl's ``RewardModelWorker`` loads the checkpoint as a token-classification model and keeps the
logit of the last valid token (the last position where ``attention_mask`` is 1). posttrain loads it
as the ``...ForSequenceClassification`` class it was saved as and reads the same number: the
per-token output of its ``score`` head at that position. Hugging Face's own pooling is not used,
because it looks for the last token that differs from ``pad_token_id``, and chat models often pad
with their eos token, which is also the last token a response scores.

Shapes: ``B`` rows, ``S`` tokens per row (padded).
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Mapping

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, PretrainedConfig, PreTrainedModel

from posttrain.models.loading import load_config, parse_dtype, resolve_model_path, weights_only

__all__ = ["head_problem", "import_external_lib", "last_token_scores", "last_valid_index", "load_reward_model"]

SEQUENCE_CLASSIFICATION = "ForSequenceClassification"


def head_problem(hf_config: PretrainedConfig) -> str | None:
    """Why a checkpoint with this config cannot score responses, or None.

    Read from ``config.json`` alone (``architectures``, ``num_labels``), so it runs before any
    weights load: a causal LM folder would otherwise load with a freshly initialised random head.
    """
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not any(a.endswith(SEQUENCE_CLASSIFICATION) for a in architectures):
        saved_as = f"architectures {architectures}" if architectures else "no architectures"
        return (f"its config.json names {saved_as}; a reward model is a sequence-classification checkpoint with a "
                "score head (e.g. LlamaForSequenceClassification or Qwen2ForSequenceClassification, num_labels=1)")
    labels = getattr(hf_config, "num_labels", 1)
    if labels != 1:
        return f"it has num_labels={labels}; a reward model outputs one score (num_labels=1)"
    return None


def import_external_lib(name: str | None) -> None:
    """``reward_model.model.external_lib``: import a module (one that registers a model class) first."""
    if name:
        importlib.import_module(name)


def load_reward_model(path: str | os.PathLike, *, trust_remote_code: bool = False,
                      override_config: Mapping[str, Any] | None = None, dtype: str | torch.dtype = "fp32",
                      device: str | torch.device = "cpu", pad_token_id: int | None = None) -> PreTrainedModel:
    """The reward model in ``dtype`` on ``device``, in eval mode with gradients off.

    ``pad_token_id`` fills in a config without one (transformers refuses batches of more than one
    row otherwise); the score itself never depends on it.
    """
    config = load_config(path, trust_remote_code=trust_remote_code, override_config=override_config)
    problem = head_problem(config)
    if problem is not None:
        raise ValueError(f"{path}: {problem}")
    text_config = config.get_text_config()
    if text_config.pad_token_id is None and pad_token_id is not None:
        text_config.pad_token_id = pad_token_id
    where = resolve_model_path(path)
    with weights_only(where.source):
        model = AutoModelForSequenceClassification.from_pretrained(
            where.source, config=config, trust_remote_code=trust_remote_code, dtype=parse_dtype(dtype),
            **where.kwargs())
    if not isinstance(getattr(model, "score", None), nn.Linear):
        raise ValueError(f"{path}: {type(model).__name__} has no linear `score` head to read per-token scores from; "
                         "posttrain reads decoder reward models (Llama, Qwen, Mistral, Gemma, GPT-2 style)")
    return model.to(device).eval().requires_grad_(False)


def last_valid_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` column of each row's last 1 in ``attention_mask [B, S]`` (0 for an empty row)."""
    cols = torch.arange(attention_mask.shape[1], device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), cols, torch.zeros_like(cols)).max(dim=1).values


def last_token_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      position_ids: torch.Tensor) -> torch.Tensor:
    """``[B]`` float32: the ``score`` head's output at each row's last valid token (verl's rule).

    The whole model runs (not its backbone and head separately), so an FSDP-sharded root gathers
    its own parameters as usual; a hook on the head keeps its per-token output ``[B, S, 1]``.
    """
    per_token: list[torch.Tensor] = []
    hook = model.score.register_forward_hook(lambda _module, _inputs, out: per_token.append(out))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    finally:
        hook.remove()
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    return per_token[-1][rows, last_valid_index(attention_mask), 0].float()
