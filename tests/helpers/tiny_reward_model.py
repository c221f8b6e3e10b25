"""Tiny reward models for tests: a 2-layer random ``LlamaForSequenceClassification`` (one label) on the
char-level test tokenizer, saved to a folder with a tokenizer whose chat template differs from the
actor's (so re-templating is visible in the text the reward model reads)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from helpers.tokenizer import build_tiny_tokenizer

__all__ = ["RM_CHAT_TEMPLATE", "build_rm_tokenizer", "tiny_reward_model", "tiny_reward_model_dir"]

RM_CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}"
"""The reward model's own template: ``[user]: ...\\n[assistant]: ...\\n`` (the actor's is ChatML-like)."""


def build_rm_tokenizer():
    """The test tokenizer's vocabulary with the reward model's template."""
    return build_tiny_tokenizer(chat_template=RM_CHAT_TEMPLATE)


def tiny_reward_model(tokenizer, seed: int = 1, num_labels: int = 1) -> LlamaForSequenceClassification:
    """Random, float32, eval mode; ``pad_token_id`` from ``tokenizer``. The head is scaled up so that
    scores differ clearly between texts (a fresh head's outputs are ~1e-2)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, max_position_embeddings=512, num_labels=num_labels,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.mul_(20.0)
    return model.eval()


def tiny_reward_model_dir(tmp_path: Path, *, num_labels: int = 1, with_tokenizer: bool = True,
                          name: str = "tiny_rm") -> Path:
    """A saved tiny reward model (+ its tokenizer) folder."""
    out = Path(tmp_path) / name
    if not (out / "config.json").exists():
        tok = build_rm_tokenizer()
        tiny_reward_model(tok, num_labels=num_labels).save_pretrained(out)
        if with_tokenizer:
            tok.save_pretrained(out)
    return out
