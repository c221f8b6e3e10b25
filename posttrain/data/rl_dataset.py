"""Prompt datasets in verl's RL schema: read, validate, tokenize with the chat template, collate.

Prompts are tokenized once, when the dataset is built, so a bad or overlong row fails at start-up
with its file and row index rather than in the middle of training.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import torch
from torch.utils.data import Dataset

from posttrain.batch import Batch, to_object_array
from posttrain.data.schema import DataError, read_rows, validate_row

__all__ = [
    "RLHFDataset",
    "collate_prompts",
    "render_prompt",
    "encode_prompts",
    "tool_schemas_of",
    "TRUNCATION_MODES",
]

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "middle")


def render_prompt(tokenizer, messages: Sequence[dict], apply_chat_template_kwargs: dict | None = None,
                  tools: Sequence[dict] | None = None) -> str:
    """The prompt text the model sees, ending where the assistant's answer starts.

    With a chat template: ``tokenizer.apply_chat_template(messages, add_generation_prompt=True,
    tokenize=False, tools=tools)`` (``tools``: OpenAI function schemas, which templates such as Qwen's
    render as a tools block; a template that ignores them renders the same text). Without one (plain
    base-model tokenizers), a documented fallback: one ``"{role}: {content}"`` line per message followed
    by ``"assistant:"`` (tools are not rendered there).
    """
    if getattr(tokenizer, "chat_template", None):
        kwargs = dict(apply_chat_template_kwargs or {})
        for k in ("tokenize", "return_dict", "return_tensors", "add_generation_prompt"):
            kwargs.pop(k, None)
        if tools:
            kwargs.setdefault("tools", list(tools))  # data.apply_chat_template_kwargs.tools, if given, wins
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **kwargs)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def encode_prompts(
    tokenizer, prompts: Sequence[Sequence[dict]], apply_chat_template_kwargs: dict | None = None,
    tools: Sequence[dict] | None = None,
) -> list[list[int]]:
    """Token ids of each rendered prompt; equal to ``apply_chat_template(..., tokenize=True)``, which
    also encodes the rendered text without adding special tokens (the template has them)."""
    texts = [render_prompt(tokenizer, m, apply_chat_template_kwargs, tools) for m in prompts]
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def tool_schemas_of(tool_config_path: str | None) -> list[dict] | None:
    """The OpenAI function schemas of the tools a tool YAML names, in file order, as the chat template
    takes them (verl's ``data.tool_config_path``); None without a path. The rollout offers the same
    tools, so the prompt must announce them: a template with a tools block (Qwen's) otherwise tells the
    model of no tool at all."""
    if not tool_config_path:
        return None
    from posttrain.tools.registry import load_tools_config  # the tool classes only when tools are named

    return [tool.tool_schema.model_dump() for tool in load_tools_config(str(tool_config_path))]


def _truncate(ids: list[int], max_len: int, mode: str) -> list[int]:
    # verl's postprocess_data: 'left' keeps the end, 'right' the start, 'middle' both ends.
    if mode == "left":
        return ids[-max_len:]
    if mode == "right":
        return ids[:max_len]
    left = max_len // 2
    return ids[:left] + ids[len(ids) - (max_len - left) :]


class RLHFDataset(Dataset):
    """Prompts from one or more parquet/jsonl files in verl's schema, tokenized with the chat template.

    Args:
        files: one path or a list (``data.train_files`` / ``data.val_files``).
        tokenizer: a Hugging Face tokenizer (with or without a chat template).
        data_config: the ``data`` config section; reads ``prompt_key``, ``reward_fn_key``,
            ``max_prompt_length``, ``filter_overlong_prompts``, ``truncation``, ``return_raw_chat``,
            ``apply_chat_template_kwargs``, ``tool_config_path`` (verl's key, which follows
            ``actor_rollout_ref.rollout.multi_turn.tool_config_path``: the tools' schemas are passed to
            the chat template, so prompts announce the tools the rollout offers and their length counts).

    Attributes:
        num_filtered: prompts dropped by ``filter_overlong_prompts`` (also logged as a warning).
        num_truncated: prompts cut to ``max_prompt_length`` by ``truncation``.
        tool_schemas: the schemas rendered into every prompt (None: no tools).
        extra_columns: row columns each item also carries (None where a row lacks one): on-policy
            distillation's ``distillation.teacher_key`` when it is not a column items carry anyway.
    """

    def __init__(self, files: str | Sequence[str], tokenizer, data_config):
        self.files = [str(files)] if isinstance(files, (str, os.PathLike)) else [str(f) for f in files]
        if not self.files:
            raise DataError("no data files given")
        self.tokenizer = tokenizer
        self.prompt_key: str = data_config.prompt_key
        self.reward_fn_key: str = data_config.reward_fn_key
        self.max_prompt_length: int = data_config.max_prompt_length
        self.filter_overlong_prompts: bool = data_config.filter_overlong_prompts
        self.truncation: str = data_config.truncation
        self.return_raw_chat: bool = data_config.return_raw_chat
        self.apply_chat_template_kwargs: dict = dict(data_config.apply_chat_template_kwargs or {})
        self.tool_schemas = tool_schemas_of(_resolved(getattr(data_config, "tool_config_path", None)))
        self.media_keys = {kind: getattr(data_config, f"{kind}_key", None) for kind in MEDIA_KINDS}
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={self.truncation!r}; expected one of {list(TRUNCATION_MODES)}")
        self.pad_token_id = _pad_id(tokenizer)
        self.rows: list[dict] = []
        self.input_ids: list[list[int]] = []
        self.num_filtered = 0
        self.num_truncated = 0
        self.extra_columns: tuple[str, ...] = ()
        for path in self.files:
            self._load_file(path)
        if self.num_filtered:
            logger.warning(
                "filtered %d of %d prompts longer than data.max_prompt_length=%d tokens (data.filter_overlong_prompts)",
                self.num_filtered,
                self.num_filtered + len(self.rows),
                self.max_prompt_length,
            )
        if self.num_truncated:
            logger.warning(
                "truncated %d prompts to data.max_prompt_length=%d tokens (data.truncation=%s)",
                self.num_truncated,
                self.max_prompt_length,
                self.truncation,
            )
        if not self.rows:
            raise DataError(f"{', '.join(self.files)}: no usable prompts (filtered {self.num_filtered} as overlong)")

    def _load_file(self, path: str) -> None:
        rows = read_rows(path)
        for i, row in enumerate(rows):
            validate_row(row, f"{path} row {i}", self.prompt_key, self.reward_fn_key)
            media_problem(row, f"{path} row {i}", self.media_keys)
        ids_all = encode_prompts(self.tokenizer, [r[self.prompt_key] for r in rows], self.apply_chat_template_kwargs,
                                 self.tool_schemas)
        for i, (row, ids) in enumerate(zip(rows, ids_all)):
            if len(ids) > self.max_prompt_length:
                if self.filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                if self.truncation == "error":
                    raise DataError(
                        f"{path} row {i}: prompt is {len(ids)} tokens, longer than "
                        f"data.max_prompt_length={self.max_prompt_length}; raise data.max_prompt_length, set "
                        "data.filter_overlong_prompts=True, or data.truncation=left|right|middle"
                    )
                ids = _truncate(ids, self.max_prompt_length, self.truncation)
                self.num_truncated += 1
            self.rows.append(row)
            self.input_ids.append(ids)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.rows[i]
        ids = torch.tensor(self.input_ids[i], dtype=torch.long)
        extra = row.get("extra_info") or {}
        item = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "data_source": row.get("data_source"),
            "reward_model": row["reward_model"],
            "extra_info": extra,
            # verl reads extra_info.index; rows without one get their position in the dataset.
            "index": extra["index"] if extra.get("index") is not None else i,
        }
        if self.reward_fn_key != "data_source":
            item[self.reward_fn_key] = row[self.reward_fn_key]
        if row.get("ability") is not None:
            item["ability"] = row["ability"]
        if row.get("agent_name") is not None:  # verl's per-row agent loop (multi-turn rollouts)
            item["agent_name"] = row["agent_name"]
        if self.return_raw_chat:
            item["raw_prompt"] = list(row[self.prompt_key])
        for key in self.extra_columns:
            item.setdefault(key, row.get(key))
        return item

    def collate_fn(self, items: Sequence[dict[str, Any]]) -> Batch:
        """Left-pad ``items`` into a :class:`Batch` (see :func:`collate_prompts`)."""
        return collate_prompts(items, self.pad_token_id)


MEDIA_KINDS = ("image", "video", "audio")
"""verl's multimodal columns (``data.image_key``, ``video_key``, ``audio_key``)."""


def media_problem(row: dict, where: str, keys: dict[str, Any]) -> None:
    """DataError for a row that holds images, videos or audio in verl's columns: posttrain trains text models.
    An absent, null or empty column is text data (verl's keys then have no effect)."""
    for kind, key in keys.items():
        value = row.get(key) if key else None
        if value is not None and not (hasattr(value, "__len__") and len(value) == 0):
            raise DataError(f"{where}: column {key!r} (data.{kind}_key) holds {kind} inputs; vision and audio "
                            "training is not supported yet (posttrain trains text models): use text-only rows, or "
                            f"point data.{kind}_key at a column that does not exist")


def _resolved(value: Any) -> Any:
    """``value``, or None when it is an interpolation nobody resolved: a config section built directly
    (``DataConfig()``, not through the loader) keeps the ``${...}`` text of a default that follows
    another key, and there is no other key to follow."""
    return None if isinstance(value, str) and value.startswith("${") else value


def _pad_id(tokenizer) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise ValueError("the tokenizer has neither a pad token nor an eos token to pad prompts with")
    return int(pad)


def collate_prompts(items: Sequence[dict[str, Any]], pad_token_id: int) -> Batch:
    """Items from :class:`RLHFDataset` -> Batch with left-padded prompts, padded to the longest one.

    Tensors: ``input_ids``, ``attention_mask``, ``position_ids`` ``[N, P]`` (position = cumsum of the
    mask minus 1, clipped at 0). Non-tensors: every other key (``data_source``, ``reward_model``,
    ``extra_info``, ``index``, ``raw_prompt`` when asked, ...) as object arrays.
    """
    if not items:
        raise ValueError("collate_prompts got no items")
    n = len(items)
    width = max(len(it["input_ids"]) for it in items)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    for r, it in enumerate(items):
        ids = torch.as_tensor(it["input_ids"], dtype=torch.long)
        if len(ids):
            input_ids[r, width - len(ids) :] = ids
            attention_mask[r, width - len(ids) :] = 1
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    keys = [k for k in items[0] if k not in ("input_ids", "attention_mask")]
    non_tensors = {k: to_object_array(it.get(k) for it in items) for k in keys}
    return Batch.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        non_tensors=non_tensors,
    )

