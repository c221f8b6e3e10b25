"""The critic's value model: a causal-LM backbone plus a scalar value head.

verl builds its critic with ``AutoModelForTokenClassification(num_labels=1)`` (a randomly
initialised ``score`` head on the backbone). We keep the backbone of the *causal LM* (so any model
``load_causal_lm`` can load, GGUF included, works as a critic) and add ``value_head``, a
``Linear(hidden, 1)`` initialised to **zero** (weight and bias): initial values are exactly 0, and
the first updates train the head before the backbone (its gradient flows through the head's
weights). Values are read in float32.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch
from torch import nn
from transformers import PreTrainedModel

from posttrain.models.loading import load_causal_lm

__all__ = ["ValueModel", "load_value_model", "backbone_of", "value_model_from_lm"]


def backbone_of(lm: PreTrainedModel) -> nn.Module:
    """The transformer body of a causal LM (``lm.model`` for Llama/Qwen): hidden states, no lm_head."""
    body = getattr(lm, "base_model", None)
    if body is None or body is lm:
        raise TypeError(f"{type(lm).__name__} exposes no separate base_model (backbone)")
    return body


class ValueModel(nn.Module):
    """``values = value_head(backbone(input_ids)).squeeze(-1)``: one scalar per position.

    Args:
        backbone: a HF base model returning ``last_hidden_state`` ``[B, S, H]``.
        hidden_size: H.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self):
        return self.backbone.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids/attention_mask/position_ids ``[B, S]`` -> values ``[B, S]`` float32."""
        hidden = self.hidden_states(input_ids, attention_mask, position_ids)
        return self.values_from_hidden(hidden)

    def hidden_states(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        """Backbone output ``[B, S, H]``."""
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return out.last_hidden_state

    def values_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[...]`` float32."""
        return self.value_head(hidden).squeeze(-1).float()


def load_value_model(
    path: str | os.PathLike,
    *,
    trust_remote_code: bool = False,
    override_config: Mapping[str, Any] | None = None,
    enable_gradient_checkpointing: bool = False,
    dtype: str | torch.dtype = "fp32",
    device: str | torch.device = "cpu",
) -> ValueModel:
    """A :class:`ValueModel` whose backbone comes from the causal-LM checkpoint at ``path``."""
    lm = load_causal_lm(
        path, trust_remote_code=trust_remote_code, override_config=override_config,
        enable_gradient_checkpointing=enable_gradient_checkpointing, dtype=dtype, device=device,
    )
    return value_model_from_lm(lm)


def value_model_from_lm(lm: PreTrainedModel) -> ValueModel:
    """Wrap ``lm``'s backbone (shared, not copied) with a zero-initialised value head."""
    body = backbone_of(lm)
    param = next(body.parameters())
    model = ValueModel(body, lm.config.hidden_size)
    return model.to(device=param.device, dtype=param.dtype)
