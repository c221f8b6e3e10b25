"""Preference pairs for DPO: read ``prompt``/``chosen``/``rejected`` rows, validate, tokenize, collate.

Rows (parquet or JSON lines; column names configurable, TRL's by default) come in TRL's forms::

    {"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"}                       # standard text
    {"prompt": [{"role": "user", "content": "What is 2+2?"}],                         # conversational
     "chosen": [{"role": "assistant", "content": "4"}],
     "rejected": [{"role": "assistant", "content": "5"}]}
    {"chosen": [{"role": "user", ...}, {"role": "assistant", "content": "4"}],        # implicit prompt:
     "rejected": [{"role": "user", ...}, {"role": "assistant", "content": "5"}]}      # the shared prefix

Tokens, for an instruct model (``apply_chat_template=True``, the default): the prompt is rendered
exactly as the RL prompts are (`posttrain.data.rl_dataset.render_prompt`: the chat template with the
generation prompt; a text prompt becomes one user message), and a response is what the template
writes after that prompt for the assistant message(s), up to and including the last end-of-turn
token (the tokenizer's EOS; SmolLM2: ``<|im_end|>``), which is appended when the template writes
none. The template's text after the end of turn (ChatML's newline) is left out: generation stops at
EOS, so the model never produces it. Prompt and response are encoded separately, as a rollout sees
them (TRL encodes prompt + response together and splits where they diverge). With
``apply_chat_template=False`` text rows are encoded as they are, and EOS is appended to responses.

Lengths: ``max_length`` bounds prompt + response (each of chosen and rejected); a longer pair
follows ``truncation`` (verl's SFT key): ``error`` names the row, ``right`` cuts the ends of the
responses, ``left`` cuts the start of the prompt (both responses keep the same prompt). One warning
says how many pairs were cut.

Bad rows (a missing column, a wrong type, an empty prompt / chosen / rejected, chosen equal to
rejected, a mismatched prompt in the implicit form, a pair that does not fit) raise one
:class:`PreferenceRowError` naming file, row and column; ``on_bad_row="skip"`` counts them by reason
instead and logs how many were skipped and why.

Collated pairs (:func:`collate_pairs`) are laid out as the rollout's output, so the actor's
log-prob code (shared-prompt forward included) runs on them unchanged: rows ``chosen_0,
rejected_0, chosen_1, ...``. This is the one reader of preference rows: the DPO trainer builds it
from its ``data.*`` keys (:meth:`PreferenceDataset.from_data_config`).
"""

from __future__ import annotations

import itertools
import logging
import os
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from posttrain.batch import Batch, to_object_array
from posttrain.data.rl_dataset import render_prompt
from posttrain.data.schema import DataError, read_rows

__all__ = ["ON_BAD_ROW", "PAIR_TRUNCATION_MODES", "PreferenceDataset", "PreferencePair", "PreferenceRowError",
           "collate_pairs", "fit_pair", "pair_parts", "tokenize_pair"]

logger = logging.getLogger(__name__)

PAIR_TRUNCATION_MODES = ("error", "left", "right")
ON_BAD_ROW = ("error", "skip")


class PreferenceRowError(DataError):
    """One preference row is unusable; ``reason`` is its short kind (what a skip is counted under)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class PreferencePair:
    """One tokenized pair: prompt ids, and the chosen / rejected response ids (end of turn included)."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


# ------------------------------------------------------------------------------------------------
# validation: a row -> (prompt, chosen, rejected) in one form


def _is_messages(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def _check_messages(value: list, where: str, column: str) -> list[dict]:
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise PreferenceRowError(f"{where}, column {column!r}: message {j} must be a dict with string 'role' and "
                                     f"'content', got {m!r}", "wrong type")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _is_empty(value: str | list[dict]) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return all(not m["content"].strip() for m in value)


def _get(row: dict, key: str, where: str, role: str, required: bool = True) -> Any:
    value = row.get(key)
    if value is None and required:
        raise PreferenceRowError(f"{where}: missing column {key!r} ({role}_key); columns: {sorted(row)}",
                                 "missing column")
    if value is not None and not isinstance(value, str) and not _is_messages(value):
        raise PreferenceRowError(f"{where}, column {key!r}: must be text or a list of {{'role', 'content'}} messages, "
                                 f"got {type(value).__name__}", "wrong type")
    return value


def _split_implicit_prompt(chosen: list[dict], rejected: list[dict], where: str, keys: tuple[str, str, str]):
    """(prompt, chosen reply, rejected reply) of two whole conversations: the prompt is their shared
    prefix, and what follows it must be assistant messages in both."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise PreferenceRowError(
            f"{where}: mismatched prompt: without a {keys[0]!r} column, columns {keys[1]!r} and {keys[2]!r} must be "
            "whole conversations that share their prompt messages, and these differ from the first message on",
            "mismatched prompt")
    if shared == len(chosen) == len(rejected):
        raise PreferenceRowError(f"{where}: columns {keys[1]!r} and {keys[2]!r} are the same conversation",
                                 "chosen == rejected")
    for key, messages in ((keys[1], chosen), (keys[2], rejected)):
        other = next((j for j in range(shared, len(messages)) if messages[j]["role"] != "assistant"), None)
        if other is not None:
            raise PreferenceRowError(
                f"{where}, column {key!r}: mismatched prompt: chosen and rejected differ from message {shared} on, "
                f"and message {other} there is a {messages[other]['role']!r} message; without a {keys[0]!r} column "
                "the two conversations must share every message before the assistant's final reply",
                "mismatched prompt")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def pair_parts(row: dict, where: str, keys: tuple[str, str, str] = ("prompt", "chosen", "rejected")):
    """``(prompt, chosen, rejected)`` of a row, all text or all message lists (the prompt of the
    implicit form extracted); :class:`PreferenceRowError` for a bad row. ``keys``: the column names
    of prompt, chosen and rejected."""
    prompt_key, chosen_key, rejected_key = keys
    chosen = _get(row, chosen_key, where, "chosen")
    rejected = _get(row, rejected_key, where, "rejected")
    prompt = _get(row, prompt_key, where, "prompt", required=not _is_messages(chosen))
    kinds = {k: ("messages" if _is_messages(v) else "text") for k, v in
             ((prompt_key, prompt), (chosen_key, chosen), (rejected_key, rejected)) if v is not None}
    if len(set(kinds.values())) > 1:
        raise PreferenceRowError(f"{where}: columns mix text and message lists ({kinds}); use one form per row",
                                 "wrong type")
    if _is_messages(chosen):
        chosen = _check_messages(chosen, where, chosen_key)
        rejected = _check_messages(rejected, where, rejected_key)
        for key, messages, name in ((chosen_key, chosen, "chosen"), (rejected_key, rejected, "rejected")):
            if _is_empty(messages):
                raise PreferenceRowError(f"{where}, column {key!r}: empty {name}", f"empty {name}")
        if prompt is None:
            prompt, chosen, rejected = _split_implicit_prompt(chosen, rejected, where, keys)
        else:
            prompt = _check_messages(prompt, where, prompt_key)
            for key, messages in ((chosen_key, chosen), (rejected_key, rejected)):
                role = next((m["role"] for m in messages if m["role"] != "assistant"), None)
                if role is not None:
                    raise PreferenceRowError(
                        f"{where}, column {key!r}: has a {role!r} message; with a {prompt_key!r} column, chosen and "
                        f"rejected hold only the assistant's reply (drop the {prompt_key!r} column for whole "
                        "conversations with a shared prefix)", "mismatched prompt")
    for key, value, name in ((prompt_key, prompt, "prompt"), (chosen_key, chosen, "chosen"),
                             (rejected_key, rejected, "rejected")):
        if _is_empty(value):
            raise PreferenceRowError(f"{where}, column {key!r}: empty {name}", f"empty {name}")
    if chosen == rejected:
        raise PreferenceRowError(f"{where}, columns {chosen_key!r} and {rejected_key!r}: chosen equals rejected "
                                 "(the pair carries no preference)", "chosen == rejected")
    return prompt, chosen, rejected


# ------------------------------------------------------------------------------------------------
# tokenization


def _template_kwargs(kwargs: dict | None) -> dict:
    kwargs = dict(kwargs or {})
    for k in ("tokenize", "return_dict", "return_tensors", "add_generation_prompt"):
        kwargs.pop(k, None)
    return kwargs


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _eos_id(tokenizer) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError("the tokenizer has no eos token to end responses with")
    return int(eos)


def _through_last_eos(ids: list[int], eos: int) -> list[int]:
    """``ids`` up to and including the last EOS; with EOS appended when there is none."""
    last = max((k for k, t in enumerate(ids) if t == eos), default=None)
    return ids[: last + 1] if last is not None else ids + [eos]


def _response_ids(tokenizer, prompt: list[dict], prompt_text: str, reply: list[dict], where: str, column: str,
                  template_kwargs: dict) -> list[int]:
    eos = _eos_id(tokenizer)
    if not getattr(tokenizer, "chat_template", None):  # render_prompt's fallback ends with "assistant:"
        return _encode(tokenizer, " " + "\n".join(m["content"] for m in reply)) + [eos]
    full = tokenizer.apply_chat_template(list(prompt) + list(reply), tokenize=False, **template_kwargs)
    if not full.startswith(prompt_text):
        raise PreferenceRowError(
            f"{where}, column {column!r}: the chat template renders the prompt differently once the reply follows "
            "it, so the reply cannot be cut from the conversation; use a template that renders earlier turns the "
            "same way (actor_rollout_ref.model.custom_chat_template)", "chat template")
    return _through_last_eos(_encode(tokenizer, full[len(prompt_text):]), eos)


def tokenize_pair(tokenizer, prompt: str | list[dict], chosen: str | list[dict], rejected: str | list[dict], *,
                  where: str = "pair", keys: tuple[str, str, str] = ("prompt", "chosen", "rejected"),
                  apply_chat_template: bool = True, apply_chat_template_kwargs: dict | None = None) -> PreferencePair:
    """Token ids of one validated pair (see the module docstring), before any truncation.

    ``prompt``/``chosen``/``rejected`` as :func:`pair_parts` returns them. Raises
    :class:`PreferenceRowError` when chosen and rejected encode to the same tokens.
    """
    if isinstance(chosen, str) and not apply_chat_template:
        eos = _eos_id(tokenizer)
        pair = PreferencePair(_encode(tokenizer, prompt), _encode(tokenizer, chosen) + [eos],
                              _encode(tokenizer, rejected) + [eos])
    else:
        if isinstance(chosen, str):
            prompt = [{"role": "user", "content": prompt}]
            chosen = [{"role": "assistant", "content": chosen}]
            rejected = [{"role": "assistant", "content": rejected}]
        kwargs = _template_kwargs(apply_chat_template_kwargs)
        try:
            prompt_text = render_prompt(tokenizer, prompt, kwargs)
            pair = PreferencePair(_encode(tokenizer, prompt_text),
                                  _response_ids(tokenizer, prompt, prompt_text, chosen, where, keys[1], kwargs),
                                  _response_ids(tokenizer, prompt, prompt_text, rejected, where, keys[2], kwargs))
        except PreferenceRowError:
            raise
        except Exception as err:  # the template's own refusal (e.g. roles that must alternate): this row's fault
            raise PreferenceRowError(f"{where}: the chat template cannot render this pair ({type(err).__name__}: "
                                     f"{str(err)[:300]})", "chat template") from None
    if pair.chosen_ids == pair.rejected_ids:
        raise PreferenceRowError(f"{where}, columns {keys[1]!r} and {keys[2]!r}: chosen and rejected encode to the "
                                 "same tokens (the pair carries no preference)", "chosen == rejected")
    return pair


def fit_pair(pair: PreferencePair, max_length: int | None, truncation: str, where: str = "pair",
             keys: tuple[str, str, str] = ("prompt", "chosen", "rejected")) -> tuple[PreferencePair, bool]:
    """``(pair, truncated)``: ``pair`` with prompt + each response at most ``max_length`` tokens.

    ``truncation``: ``error`` raises :class:`PreferenceRowError` naming the row and column;
    ``right`` cuts the responses' ends (the prompt must leave room for one response token);
    ``left`` cuts the prompt's start by what the longer response needs (the responses must leave
    room for one prompt token). ``max_length=None``: no limit.
    """
    if truncation not in PAIR_TRUNCATION_MODES:
        raise DataError(f"truncation={truncation!r}; expected one of {list(PAIR_TRUNCATION_MODES)}")
    p, c, r = len(pair.prompt_ids), len(pair.chosen_ids), len(pair.rejected_ids)
    if max_length is None or p + max(c, r) <= max_length:
        return pair, False
    longer, n = (keys[1], c) if c >= r else (keys[2], r)
    if truncation == "error":
        what = (f"column {keys[0]!r}: prompt is {p} tokens, which leaves no room for a response within "
                f"max_length={max_length}" if p >= max_length else
                f"column {longer!r}: prompt ({p} tokens) + response ({n} tokens) = {p + n} tokens, longer than "
                f"max_length={max_length}")
        raise PreferenceRowError(f"{where}, {what}; raise max_length, set truncation=left|right, or skip such rows "
                                 "(on_bad_row=skip)", "too long")
    if truncation == "right":
        if p >= max_length:
            raise PreferenceRowError(f"{where}, column {keys[0]!r}: prompt is {p} tokens, which leaves no room for a "
                                     f"response within max_length={max_length} (truncation=right keeps the whole "
                                     "prompt)", "too long")
        room = max_length - p
        fitted = PreferencePair(pair.prompt_ids, pair.chosen_ids[:room], pair.rejected_ids[:room])
    else:
        if n >= max_length:
            raise PreferenceRowError(f"{where}, column {longer!r}: response is {n} tokens, which leaves no room for "
                                     f"the prompt within max_length={max_length} (truncation=left keeps whole "
                                     "responses)", "too long")
        fitted = PreferencePair(pair.prompt_ids[p - (max_length - n):], pair.chosen_ids, pair.rejected_ids)
    if fitted.chosen_ids == fitted.rejected_ids:
        raise PreferenceRowError(f"{where}, columns {keys[1]!r} and {keys[2]!r}: chosen and rejected are the same "
                                 f"once cut to max_length={max_length} (truncation={truncation})", "chosen == rejected")
    return fitted, True


# ------------------------------------------------------------------------------------------------
# dataset and collate


class PreferenceDataset(Dataset):
    """Preference pairs from one or more parquet/jsonl files, tokenized once at start-up.

    Args:
        files: one path or a list.
        tokenizer: a Hugging Face tokenizer (a chat template for message rows, or the fallback).
        prompt_key, chosen_key, rejected_key: column names (TRL's by default).
        max_length: most tokens of prompt + response (None: no limit).
        truncation: ``error`` | ``left`` | ``right`` (see :func:`fit_pair`).
        apply_chat_template: render text rows as a user message and an assistant reply (True, for
            instruct models) or encode them as they are (False).
        on_bad_row: ``error`` raises the first bad row's :class:`PreferenceRowError`; ``skip`` leaves
            bad rows out, counted in ``skipped`` (by reason) and logged.
        apply_chat_template_kwargs: extra keyword arguments of ``apply_chat_template``.
        max_rows: read only the first N rows over all files, bad ones included (None: all).

    Attributes:
        pairs: the :class:`PreferencePair` of each kept row; ``sources`` their ``"file row i"``.
        skipped: Counter of skipped rows by reason; ``num_skipped`` their total.
        num_truncated: pairs cut to ``max_length``.
        ref_logps: ``[len, 2]`` summed reference log-probs of each pair's chosen and rejected response,
            once :meth:`set_reference_logps` stored them (DPO's ``precompute_ref_log_probs``); items and
            collated batches then carry them.
    """

    def __init__(self, files: str | Sequence[str], tokenizer, *, prompt_key: str = "prompt",
                 chosen_key: str = "chosen", rejected_key: str = "rejected", max_length: int | None = 1024,
                 truncation: str = "error", apply_chat_template: bool = True, on_bad_row: str = "error",
                 apply_chat_template_kwargs: dict | None = None, max_rows: int | None = None):
        files = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        self.files = [os.path.expanduser(str(f)) for f in files]
        if not self.files:
            raise DataError("no preference data files given")
        if truncation not in PAIR_TRUNCATION_MODES:
            raise DataError(f"truncation={truncation!r}; expected one of {list(PAIR_TRUNCATION_MODES)}")
        if on_bad_row not in ON_BAD_ROW:
            raise DataError(f"on_bad_row={on_bad_row!r}; expected one of {list(ON_BAD_ROW)}")
        if max_length is not None and max_length < 2:
            raise DataError(f"max_length={max_length}: a pair needs at least 2 tokens (one prompt, one response)")
        self.tokenizer = tokenizer
        self.keys = (prompt_key, chosen_key, rejected_key)
        self.max_length, self.truncation = max_length, truncation
        self.apply_chat_template, self.on_bad_row = apply_chat_template, on_bad_row
        self.apply_chat_template_kwargs = dict(apply_chat_template_kwargs or {})
        self.pad_token_id = _pad_id(tokenizer)
        self.pairs: list[PreferencePair] = []
        self.sources: list[str] = []
        self.skipped: Counter = Counter()
        self._first_skipped: dict[str, str] = {}
        self.num_truncated = 0
        self.ref_logps: torch.Tensor | None = None
        rows = ((path, i, row) for path in self.files for i, row in enumerate(read_rows(path)))
        for path, i, row in itertools.islice(rows, max_rows):
            self._add(row, f"{path} row {i}")
        if self.skipped:
            logger.warning("%s", self.skip_report())
        if self.num_truncated:
            logger.warning("cut %d of %d pairs to max_length=%d tokens (truncation=%s): %s", self.num_truncated,
                           len(self.pairs), max_length, truncation, ", ".join(self.files))
        if not self.pairs:
            raise DataError(f"{', '.join(self.files)}: no usable preference pairs"
                            + (f" ({self.skip_report()})" if self.skipped else ""))

    @classmethod
    def from_data_config(cls, files: str | Sequence[str], tokenizer, data_config: Any,
                         max_samples: int = -1) -> "PreferenceDataset":
        """The DPO trainer's pairs: ``data.*`` of `posttrain.config.sft.DPOConfig` (the column keys,
        ``max_length``, ``truncation``, ``on_bad_row``, ``apply_chat_template_kwargs``); ``max_samples``
        (``data.train_max_samples`` / ``val_max_samples``): the first N rows, -1 for all."""
        d = data_config
        return cls(files, tokenizer, prompt_key=d.prompt_key, chosen_key=d.chosen_key, rejected_key=d.rejected_key,
                   max_length=d.max_length, truncation=d.truncation, on_bad_row=d.on_bad_row,
                   apply_chat_template_kwargs=d.apply_chat_template_kwargs,
                   max_rows=max_samples if max_samples is not None and max_samples > 0 else None)

    def _add(self, row: dict, where: str) -> None:
        try:
            prompt, chosen, rejected = pair_parts(row, where, self.keys)
            pair = tokenize_pair(self.tokenizer, prompt, chosen, rejected, where=where, keys=self.keys,
                                 apply_chat_template=self.apply_chat_template,
                                 apply_chat_template_kwargs=self.apply_chat_template_kwargs)
            pair, truncated = fit_pair(pair, self.max_length, self.truncation, where, self.keys)
        except PreferenceRowError as err:
            if self.on_bad_row == "error":
                raise
            self.skipped[err.reason] += 1
            self._first_skipped.setdefault(err.reason, where)
            return
        self.num_truncated += truncated
        self.pairs.append(pair)
        self.sources.append(where)

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def skip_report(self) -> str:
        """``"skipped 3 of 10 rows (on_bad_row=skip): 2 empty chosen (first: f row 4), 1 too long (...)"``."""
        why = ", ".join(f"{n} {reason} (first: {self._first_skipped[reason]})"
                        for reason, n in self.skipped.most_common())
        total = self.num_skipped + len(self.pairs)
        return f"skipped {self.num_skipped} of {total} rows (on_bad_row=skip): {why}"

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, Any]:
        pair = self.pairs[i]
        item = {"prompt_ids": pair.prompt_ids, "chosen_ids": pair.chosen_ids, "rejected_ids": pair.rejected_ids,
                "index": i}
        if self.ref_logps is not None:
            item["ref_logps"] = self.ref_logps[i]
        return item

    def set_reference_logps(self, ref_logps: torch.Tensor) -> None:
        """Store ``[len, 2]`` reference log-probs (chosen, rejected) of every pair, in dataset order."""
        if tuple(ref_logps.shape) != (len(self), 2):
            raise ValueError(f"reference log-probs of shape {tuple(ref_logps.shape)}; expected ({len(self)}, 2)")
        self.ref_logps = ref_logps.detach().to(torch.float32).cpu()

    def collate_fn(self, items: Sequence[dict[str, Any]]) -> Batch:
        """``items`` -> the interleaved chosen/rejected :class:`Batch` (:func:`collate_pairs`)."""
        return collate_pairs(items, self.pad_token_id)


def _pad_id(tokenizer) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = getattr(tokenizer, "eos_token_id", None) if pad is None else pad
    if pad is None:
        raise DataError("the tokenizer has neither a pad token nor an eos token to pad pairs with")
    return int(pad)


_PAIR_KEYS = ("prompt_ids", "chosen_ids", "rejected_ids", "ref_logps")


def collate_pairs(items: Sequence[dict[str, Any] | PreferencePair], pad_token_id: int) -> Batch:
    """``B`` pairs -> a Batch of ``2B`` rows ``chosen_0, rejected_0, chosen_1, rejected_1, ...`` in the
    rollout's layout (`posttrain.rollout.hf.assemble_rollout_batch`).

    Tensors (``P``: longest prompt, ``R``: longest response): ``prompts [2B, P]`` left-padded,
    ``responses [2B, R]`` right-padded, ``response_mask [2B, R]`` (1 on response tokens, end of turn
    included), ``input_ids / attention_mask / position_ids [2B, P+R]`` (positions count the prompt's
    tokens from 0 and continue through the response), ``is_chosen [2B]`` bool, ``pair_weight [2B]``
    float ones (what the DPO update weighs each pair by; padding pairs that even out the ranks get 0),
    and ``ref_logps [2B]`` float when every item carries ``ref_logps`` (its chosen and rejected
    reference log-probs, :meth:`PreferenceDataset.set_reference_logps`). Non-tensors: ``uid``
    (one per pair, shared by its two rows: the item's ``uid``, else its ``index``, else a fresh
    uuid4) and every other key of the items, repeated on both rows. The two rows of a pair carry
    identical prompt tokens, mask and positions, so the shared-prompt forward encodes each prompt once.
    """
    if not items:
        raise ValueError("collate_pairs got no pairs")
    items = [vars(it) if isinstance(it, PreferencePair) else it for it in items]
    prompts = [list(it["prompt_ids"]) for it in items]
    responses = [list(it[key]) for it in items for key in ("chosen_ids", "rejected_ids")]
    rows = len(responses)
    width_p, width_r = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.full((rows, width_p), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, width_p), dtype=torch.long)
    response_ids = torch.full((rows, width_r), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((rows, width_r), dtype=torch.long)
    for row, resp in enumerate(responses):
        prompt = prompts[row // 2]
        if prompt:
            prompt_ids[row, width_p - len(prompt):] = torch.tensor(prompt)
            prompt_mask[row, width_p - len(prompt):] = 1
        response_ids[row, :len(resp)] = torch.tensor(resp, dtype=torch.long)
        response_mask[row, :len(resp)] = 1
    prompt_pos = (prompt_mask.cumsum(dim=-1) - 1).clamp(min=0)
    response_pos = prompt_pos[:, -1:] + torch.arange(1, width_r + 1)
    tensors = {
        "prompts": prompt_ids,
        "responses": response_ids,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        "position_ids": torch.cat([prompt_pos, response_pos], dim=1),
        "is_chosen": torch.arange(rows) % 2 == 0,
        "pair_weight": torch.ones(rows, dtype=torch.float32),
    }
    if all(it.get("ref_logps") is not None for it in items):
        tensors["ref_logps"] = torch.cat([torch.as_tensor(it["ref_logps"], dtype=torch.float32).reshape(2)
                                          for it in items])
    uids = [str(it["uid"]) if it.get("uid") is not None else
            (f"pair-{it['index']}" if it.get("index") is not None else str(uuid.uuid4())) for it in items]
    extra = [k for k in items[0] if k not in _PAIR_KEYS and k != "uid"]
    non_tensors = {"uid": np.repeat(np.array(uids, dtype=object), 2)}
    non_tensors.update({k: to_object_array(it.get(k) for it in items for _ in range(2)) for k in extra})
    return Batch.from_dict(tensors, non_tensors)
