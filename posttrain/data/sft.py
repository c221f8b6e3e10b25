"""Supervised fine-tuning rows, tokenized into the RL batch layout.

A row becomes what a rollout produces, so SFT runs through the actor's log-prob code (DPO's
preference pairs get the same layout from `posttrain.data.preference`):
``prompts`` ``[N, P]`` left-padded, ``responses`` ``[N, R]`` right-padded, ``input_ids``,
``attention_mask``, ``position_ids`` over prompt + response, and ``response_mask`` ``[N, R]`` = 1 on
the tokens that are trained.

- Single turn (``data.prompt_key`` / ``data.response_key``, optionally into dict columns with
  ``*_dict_keys``): the prompt is the chat-templated user turn up to and including the generation
  prompt (a prompt given as a list of messages is templated as it is); the response is the answer
  followed by the tokenizer's end-of-turn token (``eos_token``, ``<|im_end|>`` for ChatML models),
  all of it trained. The last prompt token is never trained, the end-of-turn token always is
  (the bug of verl #3562 was the other way round).
- Multi turn (``data.multiturn.enable``): the prompt is everything up to the first assistant
  message's generation prompt; the response is the rest. Each assistant message's tokens, up to and
  including its end-of-turn token, are trained; user, tool and system turns and the generation
  prompts are not. Segments are found by rendering the chat template over growing prefixes of the
  conversation, so any template that extends its own output works.

A row longer than ``data.max_length`` follows ``data.truncation``: ``error`` (names the file and
row), ``left`` (drops the prompt's first tokens) or ``right`` (drops the response's last tokens); one
warning says how many rows were cut. A message whose role or content is not text (an int, a dict)
is a DataError naming the file, row, message and field.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from posttrain.batch import Batch
from posttrain.data.schema import DataError, read_rows

__all__ = ["SFTDataset", "SFTExample", "collate_examples", "column_value", "load_sft_rows"]

logger = logging.getLogger(__name__)


@dataclass
class SFTExample:
    """One tokenized row: ``prompt`` ids, ``response`` ids and the response's trained-token ``mask``."""

    prompt: list[int]
    response: list[int]
    mask: list[int]
    uid: str


def load_sft_rows(files: Any, max_samples: int = -1) -> list[tuple[str, int, dict]]:
    """``(file, row index, row)`` for every row of ``files`` (a path or a list of paths)."""
    paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    out = []
    for path in paths:
        path = os.path.expanduser(str(path))
        out += [(path, i, row) for i, row in enumerate(read_rows(path))]
    if max_samples is not None and max_samples > 0:
        out = out[:max_samples]
    if not out:
        raise DataError(f"{', '.join(map(str, paths))}: no rows")
    return out


def column_value(row: dict, key: str, dict_keys: Sequence[str] | None, where: str) -> Any:
    """``row[key]``, then ``[k]`` for each of ``dict_keys`` (verl's ``prompt_dict_keys``), naming what is missing."""
    if key not in row:
        raise DataError(f"{where}: no column {key!r} (columns: {', '.join(map(str, row))})")
    value = row[key]
    path = key
    for k in dict_keys or ():
        if not isinstance(value, dict) or k not in value:
            have = f"keys {', '.join(map(str, value))}" if isinstance(value, dict) else f"a {type(value).__name__}"
            raise DataError(f"{where}: column {path!r} has no key {k!r} (it holds {have})")
        value, path = value[k], f"{path}.{k}"
    return value


def _messages(value: Any, where: str) -> list[dict] | None:
    """``value`` as a list of chat messages, or None when it is text."""
    if isinstance(value, str):
        return None
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        for j, m in enumerate(value):
            _check_message(m, f"{where}: message {j}")
        return [dict(m) for m in value]
    raise DataError(f"{where}: expected text or a list of {{role, content}} messages, got {type(value).__name__}")


def _check_message(message: dict, where: str) -> None:
    """DataError naming ``where`` and the field when a message's role or content is not text. Content
    may also be a list of parts (``[{"type": "text", "text": ...}]``) or empty beside ``tool_calls``."""
    role, content = message["role"], message["content"]
    if not isinstance(role, str):
        raise DataError(f"{where}: field 'role' must be text (user, assistant, system, tool), got "
                        f"{type(role).__name__} {role!r:.60}")
    if isinstance(content, str) or (content is None and message.get("tool_calls") is not None):
        return
    if isinstance(content, np.ndarray):
        content = content.tolist()
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        return
    raise DataError(f"{where} ({role}): field 'content' must be text, got {type(content).__name__} {content!r:.60}")


class SFTDataset:
    """Tokenized SFT rows (`SFTExample`), built once in memory; ``collate_fn`` makes the RL layout.

    Args:
        files: parquet / jsonl file(s).
        tokenizer: a Hugging Face tokenizer with a chat template and an ``eos_token``.
        data_config: ``data.*`` of `posttrain.config.sft.SFTConfig`.
    """

    def __init__(self, files: Any, tokenizer: Any, data_config: Any, max_samples: int = -1):
        self.tokenizer, self.config = tokenizer, data_config
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no eos_token: SFT trains the end-of-turn token after each response")
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.examples = [self._example(path, i, row) for path, i, row in load_sft_rows(files, max_samples)]
        self.truncated = sum(1 for e in self.examples if getattr(e, "_truncated", False))
        if self.truncated:
            logger.warning("cut %d of %d rows to data.max_length=%d tokens (data.truncation=%s): %s",
                           self.truncated, len(self.examples), data_config.max_length, data_config.truncation,
                           ", ".join(map(str, [files] if isinstance(files, (str, os.PathLike)) else files)))

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> SFTExample:
        return self.examples[i]

    def collate_fn(self, examples: Sequence[SFTExample]) -> Batch:
        return collate_examples(examples, self.pad_token_id)

    # ------------------------------------------------------------------ one row
    def _example(self, path: str, index: int, row: dict) -> SFTExample:
        where = f"{path}: row {index}"
        cfg = self.config
        if cfg.multiturn.enable:
            prompt, response, mask = self._multi_turn(row, where)
        else:
            prompt, response, mask = self._single_turn(row, where)
        return self._fit(SFTExample(prompt, response, mask, f"{os.path.basename(path)}:{index}"), where)

    def _template(self, messages: list[dict], row: dict, generation_prompt: bool, where: str) -> str:
        """The chat template's text; a row it cannot render is a DataError naming ``where``."""
        cfg = self.config
        kwargs = dict(cfg.apply_chat_template_kwargs or {})
        if cfg.multiturn.enable:
            tools = row.get(cfg.multiturn.tools_key)
            if isinstance(tools, str):  # a JSON list: parquet keeps each tool's own parameters so
                try:  # (Arrow would merge the tools' parameter structs into one)
                    tools = json.loads(tools)
                except (ValueError, RecursionError) as err:
                    raise DataError(f"{where}: column {cfg.multiturn.tools_key!r} is not a JSON list of tool "
                                    f"schemas ({type(err).__name__}: {str(err)[:200]})") from None
            if tools is not None:
                kwargs["tools"] = tools.tolist() if isinstance(tools, np.ndarray) else tools
            thinking = row.get(cfg.multiturn.enable_thinking_key)
            if thinking is not None:
                kwargs["enable_thinking"] = bool(thinking)
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation_prompt, **kwargs)
        except Exception as err:  # the template's own refusal (e.g. roles that must alternate)
            raise DataError(f"{where}: the chat template cannot render this row's messages "
                            f"({type(err).__name__}: {str(err)[:300]})") from None

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _single_turn(self, row: dict, where: str) -> tuple[list[int], list[int], list[int]]:
        cfg = self.config
        prompt = column_value(row, cfg.prompt_key, cfg.prompt_dict_keys, where)
        response = column_value(row, cfg.response_key, cfg.response_dict_keys, where)
        if not isinstance(response, str):
            raise DataError(f"{where}: column {cfg.response_key!r} must hold text, got {type(response).__name__}")
        if not response.strip():
            raise DataError(f"{where}: column {cfg.response_key!r} is empty: nothing to train on")
        messages = _messages(prompt, f"{where}: column {cfg.prompt_key!r}") or [{"role": "user", "content": str(prompt)}]
        if not str(messages[-1]["content"]).strip() and len(messages) == 1:
            raise DataError(f"{where}: column {cfg.prompt_key!r} is empty")
        prompt_ids = self._ids(self._template(messages, row, True, where))
        response_ids = self._ids(response) + [self.tokenizer.eos_token_id]
        return prompt_ids, response_ids, [1] * len(response_ids)

    def _multi_turn(self, row: dict, where: str) -> tuple[list[int], list[int], list[int]]:
        key = self.config.multiturn.messages_key
        if key not in row:
            raise DataError(f"{where}: no column {key!r} (data.multiturn.messages_key; columns: {', '.join(map(str, row))})")
        messages = _messages(row[key], f"{where}: column {key!r}")
        first = next((i for i, m in enumerate(messages or []) if m["role"] == "assistant"), None)
        if first is None:
            raise DataError(f"{where}: column {key!r} has no assistant message: nothing to train on")
        prompt_text = self._template(messages[:first], row, True, where)
        ids, mask, done = [], [], prompt_text
        for i in range(first, len(messages)):
            if messages[i]["role"] == "assistant":
                before = self._template(messages[:i], row, True, where)  # up to this message's generation prompt
                after = self._template(messages[:i + 1], row, False, where)
                _check_prefix(done, before, where, i)
                ids += self._ids(before[len(done):])
                mask += [0] * (len(ids) - len(mask))
                turn = self._assistant_ids(after[len(before):], where, i)
                ids += turn
                mask += [1] * len(turn)
                done = before + self.tokenizer.decode(turn, skip_special_tokens=False)
            # user / tool / system turns are rendered as part of the next segment, untrained
        # what follows the last assistant message (a newline, later user turns) trains nothing: left out
        return self._ids(prompt_text), ids, mask

    def _assistant_ids(self, text: str, where: str, index: int) -> list[int]:
        """An assistant segment's tokens up to and including its end-of-turn token (what follows it, such
        as the template's newline, belongs to the next segment)."""
        ids = self._ids(text)
        eos = self.tokenizer.eos_token_id
        if eos not in ids:
            raise DataError(f"{where}: message {index} (assistant) has no end-of-turn token "
                            f"{self.tokenizer.eos_token!r} after it in the chat template's output")
        return ids[:ids.index(eos) + 1]

    def _fit(self, ex: SFTExample, where: str) -> SFTExample:
        """Apply ``data.truncation`` to a row longer than ``data.max_length``."""
        limit, mode = self.config.max_length, self.config.truncation
        total = len(ex.prompt) + len(ex.response)
        if total <= limit:
            return ex
        if mode == "error":
            raise DataError(f"{where}: {total} tokens (prompt {len(ex.prompt)} + response {len(ex.response)}) is over "
                            f"data.max_length={limit}; raise data.max_length, shorten the row, or set "
                            "data.truncation=left|right")
        if mode == "right" and len(ex.prompt) < limit:
            keep = limit - len(ex.prompt)
            ex = SFTExample(ex.prompt, ex.response[:keep], ex.mask[:keep], ex.uid)
        elif mode == "left" and len(ex.response) < limit:
            ex = SFTExample(ex.prompt[len(ex.prompt) - (limit - len(ex.response)):], ex.response, ex.mask, ex.uid)
        else:
            part = "prompt" if mode == "right" else "response"
            raise DataError(f"{where}: its {part} alone ({len(ex.prompt if mode == 'right' else ex.response)} tokens) "
                            f"fills data.max_length={limit}, so data.truncation={mode} leaves nothing to train on")
        if not any(ex.mask):
            raise DataError(f"{where}: after data.truncation={mode} to {limit} tokens no trained token is left")
        ex._truncated = True  # type: ignore[attr-defined]
        return ex


def _check_prefix(done: str, before: str, where: str, index: int) -> None:
    if not before.startswith(done):
        raise DataError(f"{where}: the chat template does not extend its own output at message {index}, so the "
                        "assistant turns cannot be located token by token (a template that rewrites earlier turns)")


def collate_examples(examples: Sequence[SFTExample], pad_token_id: int) -> Batch:
    """The RL layout (module docstring) of ``examples``; ``uid`` per row."""
    n = len(examples)
    p = max(len(e.prompt) for e in examples)
    r = max(len(e.response) for e in examples)
    prompts = torch.full((n, p), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(n, p, dtype=torch.long)
    responses = torch.full((n, r), pad_token_id, dtype=torch.long)
    response_attn = torch.zeros(n, r, dtype=torch.long)
    response_mask = torch.zeros(n, r, dtype=torch.long)
    for i, e in enumerate(examples):
        prompts[i, p - len(e.prompt):] = torch.tensor(e.prompt)
        prompt_mask[i, p - len(e.prompt):] = 1
        responses[i, :len(e.response)] = torch.tensor(e.response)
        response_attn[i, :len(e.response)] = 1
        response_mask[i, :len(e.response)] = torch.tensor(e.mask)
    attention_mask = torch.cat([prompt_mask, response_attn], dim=1)
    position_ids = torch.clamp(attention_mask.cumsum(-1) - 1, min=0)
    tensors = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
               "attention_mask": attention_mask, "position_ids": position_ids, "response_mask": response_mask}
    return Batch.from_dict(tensors, {"uid": np.array([e.uid for e in examples], dtype=object)},
                           {"temperature": 1.0})
