"""One JSON record per response of a rollout batch: what `posttrain.trainer.rollout_dump` writes, one line each.

verl's `_dump_generations` fields come first, with verl's names and meanings: ``input`` (the prompt, decoded
without special tokens), ``output`` (the response, likewise), ``gts`` (``reward_model.ground_truth``),
``score`` (the response's summed ``token_level_scores``), ``step``, then each value the reward returned beside
its score (``acc``, ``flexible_acc``, ``overlong_reward``, ...). posttrain adds:

=================  ============================================================================================
uid, sample        the prompt's id (a group's responses share it) and the response's place in its group
data_source        the row's ``data_source``
reward             summed ``token_level_rewards`` (the score less an in-reward KL penalty), when present
advantage          mean advantage over the response's trained tokens (GRPO's is the same on every token)
response_length    trained tokens (``response_mask``), ``tokens`` the whole response (tool turns included)
multi_turn         the trajectory's non-zero ``multi_turn/*`` counts (turns, tool_calls, tool_errors, ...)
tokens, ids        each response token's text (decoded alone) and id: only on up to ``token_samples`` responses
mask               1 on model tokens, 0 on tool/user tokens (only where some are 0: multi-turn)
logprobs           per token: ``rollout`` (the engine's), ``actor`` (old log-probs, where recomputed), ``ref``;
                   null on tokens the model did not write
entropy            per token, where the trainer computed it (the old log-prob pass)
advantages, values per token, where they vary along the response (GAE); values with a critic
turns              multi-turn: the trajectory as turns ``{role, start, end, text}`` over ``tokens``; an assistant
                   turn's ``calls`` (``name``, ``arguments``, ``status``: ok | error | invalid, ``output``)
=================  ============================================================================================

Floats are rounded to `DECIMALS` places; non-finite ones are written as null (JSON has no NaN).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["DECIMALS", "TokenText", "batch_records", "correct", "group_order", "step_summary"]

DECIMALS = 4
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_RESPONSE = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.DOTALL)


class TokenText:
    """Each token id's text decoded alone (remembered: a vocabulary's ids repeat across steps)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.known = tokenizer, {}

    def __call__(self, ids: Sequence[int]) -> list[str]:
        missing = sorted({i for i in ids if i not in self.known})
        if missing:
            for i, text in zip(missing, self.tokenizer.batch_decode([[i] for i in missing])):
                self.known[i] = text
        return [self.known[i] for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def _floats(values: np.ndarray) -> list:
    """Rounded floats, None where not finite."""
    rounded = np.round(values.astype(np.float64), DECIMALS)
    out = rounded.tolist()
    if not np.isfinite(rounded).all():
        out = [v if math.isfinite(v) else None for v in out]
    return out


def _number(value: float) -> float | None:
    value = float(value)
    return round(value, 6) if math.isfinite(value) else None


def _jsonable(value: Any) -> Any:
    """A plain JSON value (numpy scalars and arrays as numbers and lists; a non-finite float as None)."""
    if isinstance(value, np.generic):
        value = value.item()
    elif isinstance(value, np.ndarray):
        value = value.tolist()
    return None if isinstance(value, float) and not math.isfinite(value) else value


def group_order(uids: Sequence[Any]) -> list[int]:
    """Row indices with each group's rows together, groups in the order they first appear (a balanced
    batch may have interleaved them)."""
    first: dict[Any, int] = {}
    for i, uid in enumerate(uids):
        first.setdefault(uid, len(first))
    return sorted(range(len(uids)), key=lambda i: (first[uids[i]], i))


def _rows_with_tokens(uids: list, order: list[int], limit: int) -> set[int]:
    """The rows of the first whole groups that fit in ``limit`` responses (at least one group)."""
    groups: dict[Any, list[int]] = {}
    for i in order:
        groups.setdefault(uids[i], []).append(i)
    kept: set[int] = set()
    for rows in groups.values():
        if kept and len(kept) + len(rows) > limit:
            break
        kept.update(rows)
    return kept


def batch_records(batch: Any, text: TokenText, step: int, *, extra: dict | None = None,
                  entropy: Any = None, scores: Sequence[float] | None = None, token_samples: int = 64,
                  first_sample: int = 0) -> list[dict]:
    """One record per response of ``batch`` (a `posttrain.batch.Batch` after scoring, and after the update on a
    training step), groups together. ``scores`` replaces ``token_level_scores`` (validation scores apart);
    ``token_samples`` bounds the responses that carry per-token values (whole groups)."""
    t, nt = batch.batch, batch.non_tensor_batch
    n = len(batch)
    uids = list(nt["uid"]) if "uid" in nt else [f"row-{first_sample + i}" for i in range(n)]
    order = group_order(uids)
    with_tokens = _rows_with_tokens(uids, order, token_samples)
    responses = t["responses"]
    width = responses.shape[1]
    filled = t["attention_mask"][:, -width:].bool()
    mask = t["response_mask"].bool() if "response_mask" in t.keys() else filled
    prompt_mask = t["attention_mask"][:, :-width].bool()
    prompts = t["prompts"] if "prompts" in t.keys() else t["input_ids"][:, :-width]
    seq_scores = (list(scores) if scores is not None else
                  t["token_level_scores"].sum(-1).tolist() if "token_level_scores" in t.keys() else [None] * n)
    rewards = t["token_level_rewards"].sum(-1).tolist() if "token_level_rewards" in t.keys() else None
    per_token = {name: t[key].float().cpu().numpy() for name, key in
                 (("rollout", "rollout_log_probs"), ("actor", "old_log_probs"), ("ref", "ref_log_prob"))
                 if key in t.keys()}
    if "actor" in per_token and "rollout" in per_token and np.array_equal(per_token["actor"], per_token["rollout"]):
        del per_token["actor"]  # bypass mode: the old log-probs are the engine's
    adv = t["advantages"].float().cpu().numpy() if "advantages" in t.keys() else None
    values = t["values"].float().cpu().numpy() if "values" in t.keys() else None
    ent = entropy.float().cpu().numpy() if entropy is not None else None
    mask_np, filled_np = mask.cpu().numpy(), filled.cpu().numpy()
    extras = {k: v for k, v in (extra or {}).items() if len(v) == n and not k.startswith("multi_turn/")}
    turns_cols = {k.split("/", 1)[1]: np.asarray(v) for k, v in nt.items() if k.startswith("multi_turn/")}
    group_pos: dict[Any, int] = {}
    records = []
    inputs = [text.decode(prompts[i][prompt_mask[i]].tolist()) for i in order]
    for pos, i in enumerate(order):
        ids = responses[i][filled[i]].tolist()
        trained = mask_np[i] & filled_np[i]
        rec: dict[str, Any] = {
            "input": inputs[pos], "output": text.decode(ids), "gts": _ground_truth(nt, i),
            "score": None if seq_scores[i] is None else _number(seq_scores[i]), "step": step,
        }
        rec.update({k: _jsonable(v[i]) for k, v in extras.items()})
        rec["uid"] = str(uids[i])
        rec["sample"] = group_pos[uids[i]] = group_pos.get(uids[i], -1) + 1
        if "data_source" in nt:
            rec["data_source"] = str(nt["data_source"][i])
        if rewards is not None:
            rec["reward"] = _number(rewards[i])
        if adv is not None and trained.any():
            rec["advantage"] = _number(adv[i][trained].mean())
        rec["response_length"] = int(trained.sum())
        rec["tokens_total"] = len(ids)
        counts = {k: _jsonable(v[i]) for k, v in turns_cols.items() if v[i]}
        if turns_cols:
            rec["multi_turn"] = counts
        if i in with_tokens:
            _add_tokens(rec, i, ids, text, filled_np[i], mask_np[i], per_token, ent, adv, values, bool(turns_cols))
        records.append(rec)
    return records


def _ground_truth(nt: dict, i: int) -> Any:
    rm = nt.get("reward_model")
    row = rm[i] if rm is not None else None
    return _jsonable(row.get("ground_truth")) if isinstance(row, dict) else None


def _add_tokens(rec: dict, i: int, ids: list[int], text: TokenText, filled: np.ndarray, mask: np.ndarray,
                per_token: dict, ent: Any, adv: Any, values: Any, multi_turn: bool) -> None:
    keep = filled.nonzero()[0]
    model = mask[keep].astype(bool)
    rec["tokens"], rec["ids"] = text(ids), ids
    if not model.all():
        rec["mask"] = model.astype(int).tolist()

    def column(arr: np.ndarray) -> list:
        out = _floats(arr[i][keep])
        return out if model.all() else [v if m else None for v, m in zip(out, model)]

    rec["logprobs"] = {name: column(arr) for name, arr in per_token.items()}
    if ent is not None:
        rec["entropy"] = column(ent)
    if adv is not None and model.any():
        row = adv[i][keep][model]
        if np.ptp(row) > 1e-6:
            rec["advantages"] = column(adv)
    if values is not None:
        rec["values"] = column(values)
    if multi_turn:
        rec["turns"] = trajectory_turns(ids, rec.get("mask") or [1] * len(ids), text.decode)


def trajectory_turns(ids: list[int], mask: list[int], decode: Callable[[list[int]], str]) -> list[dict]:
    """The response as turns: runs of model tokens (assistant) and of tool/user tokens, each with its text;
    an assistant turn's hermes ``<tool_call>`` blocks paired, in order, with the next tool turn's
    ``<tool_response>`` blocks (an answer starting ``Error:`` is a failed call, as the multi-turn loop writes them)."""
    turns: list[dict] = []
    start = 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or mask[k] != mask[start]:
            turns.append({"role": "assistant" if mask[start] else "tool", "start": start, "end": k,
                          "text": decode(ids[start:k])})
            start = k
    for k, turn in enumerate(turns):
        if turn["role"] == "assistant":
            turn["calls"] = [_parse_call(body) for body in _CALL.findall(turn["text"])]
            continue
        before = turns[k - 1] if k else None
        outputs = _RESPONSE.findall(turn["text"])
        if not (before and before.get("calls")):
            turn["role"] = "user"  # an interaction's reply (or a tool turn whose calls were not parsed)
            continue
        if not outputs:  # a template with a tool role: the turn's text is the answers'
            outputs = [turn["text"].strip()]
        for call, out in zip(before["calls"], outputs):
            call["output"] = out
            if call["status"] == "ok" and out.lstrip().startswith("Error:"):
                call["status"] = "error"
    return turns


def _parse_call(body: str) -> dict:
    try:
        call = json.loads(body)
        return {"name": str(call["name"]), "arguments": call.get("arguments", {}), "status": "ok"}
    except (ValueError, KeyError, TypeError):
        return {"name": "?", "arguments": body, "status": "invalid"}


def correct(rec: dict) -> bool | None:
    """Whether a response was right: the scorer's ``acc`` where it gives one, else a positive score."""
    if isinstance(rec.get("acc"), (int, float, bool)):
        return bool(rec["acc"])
    score = rec.get("score")
    return None if score is None else score > 0


def step_summary(records: list[dict]) -> dict:
    """What the index keeps of a step: counts, the mean score, groups whose responses were all right, all
    wrong or all scored alike (no signal for GRPO), failed tool calls, and the lowest-probability token."""
    groups: dict[str, list[dict]] = {}
    for rec in records:
        groups.setdefault(rec["uid"], []).append(rec)
    scores = [r["score"] for r in records if r.get("score") is not None]
    right = [[correct(r) for r in g] for g in groups.values()]
    out: dict[str, Any] = {
        "samples": len(records), "groups": len(groups),
        "token_samples": sum(1 for r in records if "tokens" in r),
        "score_mean": _number(np.mean(scores)) if scores else None,
        "all_right_groups": sum(1 for g in right if len(g) > 1 and all(x is True for x in g)),
        "all_wrong_groups": sum(1 for g in right if len(g) > 1 and all(x is False for x in g)),
        "same_score_groups": sum(1 for g in groups.values() if len(g) > 1 and len({r.get("score") for r in g}) == 1),
    }
    calls = [c for r in records for t in r.get("turns", ()) for c in t.get("calls", ())]
    errors = sum(int((r.get("multi_turn") or {}).get("tool_errors", 0)) for r in records)
    if any("multi_turn" in r for r in records):
        out["tool_calls"] = sum(int((r.get("multi_turn") or {}).get("tool_calls", 0)) for r in records)
        out["tool_errors"] = max(errors, sum(1 for c in calls if c["status"] != "ok"))
    lowest = None
    for s, rec in enumerate(records):
        lps = rec.get("logprobs") or {}
        row = lps.get("actor") or lps.get("rollout")
        for k, v in enumerate(row or ()):
            if v is not None and (lowest is None or v < lowest["logprob"]):
                lowest = {"logprob": v, "sample": s, "token": k}
    if lowest is not None:
        out["lowest"] = lowest
    return out
