"""A tiny character-level tokenizer for tests: no downloads, ~106 tokens, a ChatML-like template.

Every printable ASCII character is one token; unknown characters map to ``<unk>``.
Special tokens: ``<pad>`` (pad), ``<unk>``, ``<s>`` (bos), ``</s>``, ``<|im_start|>``,
``<|im_end|>`` (eos). ``len(tok)`` is the vocabulary size to give a tiny random model.
"""

from __future__ import annotations

import string

__all__ = ["build_tiny_tokenizer", "TINY_CHAT_TEMPLATE"]

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def build_tiny_tokenizer(chat_template: str | None = TINY_CHAT_TEMPLATE):
    """A char-level ``PreTrainedTokenizerFast`` (pad id 0, eos ``<|im_end|>``); ``chat_template=None``
    builds one without a template (to exercise the fallback)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {t: i for i, t in enumerate(_SPECIALS)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    # BPE without merges splits any text into single characters.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "</s>"],
    )
    tok.chat_template = chat_template
    return tok
