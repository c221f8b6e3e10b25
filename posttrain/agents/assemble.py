"""Token-exact trajectories from the calls an agent episode made: the sequences a trainer trains on.

Every call the server answered is recorded as token ids (:class:`Call`: the prompt it decoded from, the ids
it sampled, their log-probs). :func:`assemble` joins an episode's calls, in the order they were sent,
into training sequences without ever tokenising text again:

- a call whose prompt **extends** a sequence's context (its prompt plus everything after it so far, which
  ends with the ids last sampled there) token for token continues that sequence: the prompt's new tokens
  (tool results, user turns, the harness's own text, the template's turn markers) are appended with
  ``mask`` 0, then the sampled ids with ``mask`` 1 and their log-probs;
- a call whose prompt extends no sequence starts a new one (a **split**): its whole prompt is the new
  sequence's prompt. The split is counted by reason, judged against the sequence whose context shares the
  longest prefix with the new prompt:

  - ``branch``: the new prompt is a prefix of that context (a retry, or a second sample from the
    same point): nothing earlier was changed;
  - ``reply_rewritten``: the first differing token lies inside that sequence's last sampled reply (the
    harness re-rendered, cut or edited what the model wrote; a chat template that drops old ``<think>``
    blocks does this);
  - ``history_rewritten``: it lies before that reply (an earlier turn, the system prompt or a tool result
    changed, or a turn dropped).

  ``retokenized_tokens`` adds, per split, the context's tokens past the first difference: tokens the
  model saw or wrote that the later prompt does not repeat as they were. A harness that only appends
  has none.

A sequence ends with the ids last sampled in it (a trailing tool result is context for a call that never
came, not a thing to train on). One longer than ``response_length`` tokens after its prompt is cut there
(``truncated_tokens`` counts the sampled ids cut).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Call", "Sequence", "Assembly", "assemble", "SPLIT_REASONS", "extended_sequence"]

SPLIT_REASONS = ("branch", "reply_rewritten", "history_rewritten")


@dataclass
class Call:
    """One answered request of an episode (a chat or completion call, one choice)."""

    order: int
    """When it was sent, among the episode's calls (the server's arrival order)."""
    prompt_ids: list[int]
    sampled_ids: list[int]
    log_probs: list[float]
    finish_reason: str = "stop"
    weights_version: Any = None


@dataclass
class Sequence:
    """One training sequence: ``prompt`` then ``tokens`` (``mask`` 1 where sampled, with ``log_probs``)."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    calls: int = 0
    last_reply_at: int = 0
    """Where the last sampled reply starts in ``prompt + tokens`` (splits are judged against it)."""

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens

    def add(self, call: Call) -> None:
        """Continue with ``call``, whose prompt extends this context."""
        new = call.prompt_ids[len(self.prompt) + len(self.tokens):]
        self.tokens += new
        self.mask += [0] * len(new)
        self.log_probs += [0.0] * len(new)
        self.last_reply_at = len(self.prompt) + len(self.tokens)
        self.tokens += call.sampled_ids
        self.mask += [1] * len(call.sampled_ids)
        self.log_probs += [float(x) for x in call.log_probs]
        self.calls += 1


@dataclass
class Assembly:
    sequences: list[Sequence]
    retokenized_tokens: int = 0
    splits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLIT_REASONS, 0))
    truncated_tokens: int = 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def extended_sequence(sequences: list[Sequence], prompt: list[int]) -> Sequence | None:
    """The latest sequence whose context ``prompt`` extends token for token, or None."""
    for seq in reversed(sequences):
        context = seq.context
        if len(prompt) >= len(context) and prompt[:len(context)] == context:
            return seq
    return None


def assemble(calls: list[Call], response_length: int) -> Assembly:
    """An episode's calls -> its training sequences and counts (module docstring)."""
    out = Assembly([])
    for call in sorted(calls, key=lambda c: c.order):
        seq = extended_sequence(out.sequences, call.prompt_ids)
        if seq is None:
            if out.sequences:
                _count_split(out, call.prompt_ids)
            seq = Sequence(list(call.prompt_ids))  # the call's whole prompt is the prompt: nothing new after it
            out.sequences.append(seq)
        seq.add(call)
    for seq in out.sequences:
        _trim(seq, response_length, out)
    return out


def _count_split(out: Assembly, prompt: list[int]) -> None:
    best, common = max(((s, _common_prefix(s.context, prompt)) for s in out.sequences), key=lambda x: x[1])
    context = best.context
    if common == len(prompt):
        reason = "branch"
    else:
        reason = "reply_rewritten" if common >= best.last_reply_at else "history_rewritten"
        out.retokenized_tokens += len(context) - common
    out.splits[reason] += 1


def _trim(seq: Sequence, response_length: int, out: Assembly) -> None:
    """End the sequence at its last sampled id, and at ``response_length`` tokens after its prompt."""
    last = max((i for i, m in enumerate(seq.mask) if m), default=-1) + 1
    if last > response_length:
        out.truncated_tokens += sum(seq.mask[response_length:last])
        last = response_length
    seq.tokens, seq.mask, seq.log_probs = seq.tokens[:last], seq.mask[:last], seq.log_probs[:last]
