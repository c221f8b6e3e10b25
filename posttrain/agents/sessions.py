"""The server's side of agent episodes: one API key per episode, what each episode's calls sampled, and
each new prompt built from the episode's own tokens where the client sent its history back unchanged.

:class:`EpisodeSessions` plugs into `posttrain.serve.server.CompletionServer` four ways: ``check_key``
(``api_key``: only an open episode's key is served), ``admit`` (the batcher: a request whose episode
has closed never decodes), ``record`` (the recorder: each answered call becomes a
`posttrain.agents.assemble.Call` of its episode) and the request hook (``parse``/``refused``):

- **Sampling is the run's.** Temperature, top-p and top-k are the rollout's (the trainer's log-probs use
  them), whatever the request says; a request's ``seed`` is dropped (seeded requests decode alone); ``n``
  must be 1 (more samples of a row are more episodes: ``rollout.n``).
- **Token budget.** A call may sample at most what is left of ``rollout.response_length`` in the sequence
  its prompt continues (`posttrain.agents.assemble`): tool results count, as in the multi-turn loop.
  With nothing left it is answered at once with an empty reply, ``finish_reason="length"``.
- **History kept as tokens.** A chat request whose messages start with an earlier call's messages
  followed by that call's reply (compared by role, text without outer whitespace, and tool calls by
  name and arguments; ids aside) and whose tools are the same, gets that call's prompt ids plus its
  sampled ids, then only the new messages rendered (`posttrain.serve.chat_tools.render_after`): what the
  model wrote is never decoded and re-encoded. Any other request is rendered whole through the chat
  template (``rendered_prompts``); if that does not extend the tokens it follows, the trajectory splits
  and the retokenised tokens are counted (`posttrain.agents.assemble`).
"""

from __future__ import annotations

import json
import secrets
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from posttrain.agents.assemble import Call, assemble, extended_sequence
from posttrain.rollout.base import SamplingParams
from posttrain.serve import chat_tools
from posttrain.serve.batcher import ServeRecord
from posttrain.serve.errors import ServeError
from posttrain.serve.protocol import Job, parse_chat, parse_completion

__all__ = ["Episode", "EpisodeSessions", "SESSION_COUNTS"]

SESSION_COUNTS = ("calls", "reused_prompts", "rendered_prompts", "hit_length_limit", "tool_calls",
                  "invalid_tool_calls")
"""Per-episode counts the sessions keep (besides ``refused/<code>``)."""


@dataclass
class _Pending:
    order: int
    keys: tuple | None  # the chat request's message keys (None: a completion request)
    tools: list[dict] | None
    tools_key: str


@dataclass
class Episode:
    """One episode's key, its answered calls and counts."""

    index: int
    key: str
    calls: list[Call] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    contexts: list[tuple[tuple, str, list[int]]] = field(default_factory=list)
    """Per answered chat call: its messages' keys plus its reply's, its tools, its prompt + sampled ids."""
    pending: dict[str, _Pending] = field(default_factory=dict)
    sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def render(self, tokenizer: Any, messages: list[dict], tools: list[dict] | None, reuse: bool) -> list[int]:
        """The prompt ids of a chat request (module docstring: history kept as tokens)."""
        keys, tools_key = tuple(chat_tools.message_key(m) for m in messages), _tools_key(tools)
        with self.lock:
            contexts = list(self.contexts) if reuse else []
        for ctx_keys, ctx_tools, ids in reversed(contexts):
            if ctx_tools == tools_key and len(keys) > len(ctx_keys) and keys[:len(ctx_keys)] == ctx_keys:
                out = ids + chat_tools.render_after(tokenizer, messages[len(ctx_keys):], tools, ids[-1])
                self.count("reused_prompts")
                return out
        out = chat_tools.render_prompt(tokenizer, messages, tools)
        self.count("rendered_prompts")
        return out

    def count(self, name: str, by: int = 1) -> None:
        with self.lock:
            self.counts[name] += by

    def budget(self, prompt: list[int], response_length: int) -> int:
        """Tokens a call with ``prompt`` may still sample (module docstring: token budget)."""
        with self.lock:
            calls = list(self.calls)
        seq = extended_sequence(assemble(calls, 1 << 60).sequences, prompt)
        used = len(prompt) - len(seq.prompt) if seq is not None else 0
        return response_length - used


def _tools_key(tools: list[dict] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


class EpisodeSessions:
    """The open episodes of a rollout, by API key (module docstring).

    Args:
        reuse_history: build a prompt from the episode's own tokens where its history came back unchanged
            (True; False renders every request whole, which tests use as the control).
    """

    def __init__(self, *, reuse_history: bool = True):
        self.reuse_history = reuse_history
        self.episodes: dict[str, Episode] = {}
        self.sampling = SamplingParams()
        self.max_model_len: int | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ episodes
    def open(self, count: int, sampling: SamplingParams) -> list[Episode]:
        """``count`` new episodes, each with a fresh key, sampled with ``sampling`` (``n`` aside)."""
        episodes = [Episode(i, "episode-" + secrets.token_urlsafe(18)) for i in range(count)]
        with self._lock:
            self.sampling = sampling
            self.episodes = {e.key: e for e in episodes}
        return episodes

    def close(self) -> None:
        """Revoke every key: later requests get HTTP 401, queued ones never decode."""
        with self._lock:
            self.episodes = {}

    def check_key(self, key: str) -> bool:
        return key in self.episodes

    def admit(self, key: str | None) -> bool:
        return key is not None and key in self.episodes

    def _episode(self, key: str | None) -> Episode:
        episode = self.episodes.get(key) if key is not None else None
        if episode is None:
            raise ServeError("this API key's episode has ended", status=401, code="invalid_api_key")
        return episode

    # ------------------------------------------------------------------ the request hook
    def parse(self, kind: str, body: Any, tokenizer: Any, key: str | None) -> Job:
        episode = self._episode(key)
        if kind == "chat":
            seen: dict[str, Any] = {}

            def render(messages: list[dict], tools: list[dict] | None) -> list[int]:
                seen["keys"] = tuple(chat_tools.message_key(m) for m in messages)
                return episode.render(tokenizer, messages, tools, self.reuse_history)

            job = parse_chat(body, tokenizer, render=render)
            keys = seen["keys"]
        else:
            job, keys = parse_completion(body, tokenizer), None
            if len(job.prompts) != 1:
                raise ServeError("an episode's completion call sends one prompt", param="prompt")
        if job.n != 1:
            raise ServeError(f"n={job.n}: an episode's call samples one reply; more samples of a row are more "
                             "episodes (actor_rollout_ref.rollout.n)", param="n")
        self._run_sampling(job, episode)
        with episode.lock:
            episode.pending[job.id] = _Pending(episode.sent, keys, job.tools, _tools_key(job.tools))
            episode.sent += 1
        return job

    def _run_sampling(self, job: Job, episode: Episode) -> None:
        s = self.sampling
        job.temperature = 0.0 if s.greedy else s.temperature
        job.top_p, job.top_k, job.seed = (1.0, -1, None) if s.greedy else (s.top_p, s.top_k, None)
        prompt = job.prompts[0]
        room = episode.budget(prompt, s.response_length)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - len(prompt))
        if room <= 0:
            episode.count("hit_length_limit")
            job.max_tokens = 0
        else:
            job.max_tokens = room if job.max_tokens is None else min(job.max_tokens, room)

    def refused(self, key: str | None, error: ServeError) -> None:
        episode = self.episodes.get(key) if key is not None else None
        if episode is not None:
            episode.count(f"refused/{error.code or error.status}")

    # ------------------------------------------------------------------ the recorder
    def record(self, rec: ServeRecord) -> None:
        episode = self.episodes.get(rec.key) if rec.key is not None else None
        if episode is None:
            return
        with episode.lock:
            pending = episode.pending.pop(rec.request_id, None)
        if pending is None:
            return
        choice = rec.choices[0][0]
        prompt = list(rec.prompt_token_ids[0])
        call = Call(pending.order, prompt, list(choice.token_ids), list(choice.log_probs), choice.finish_reason,
                    rec.weights_version)
        counts = Counter(calls=1)
        context = None
        if pending.keys is not None:
            reply, invalid = chat_tools.reply_message(choice.text, pending.tools, rec.request_id, 0)
            counts.update(tool_calls=len(reply.get("tool_calls") or ()), invalid_tool_calls=invalid)
            context = (pending.keys + (chat_tools.message_key(reply),), pending.tools_key, prompt + call.sampled_ids)
        with episode.lock:
            episode.calls.append(call)
            episode.counts.update(counts)
            if context is not None and call.sampled_ids:
                episode.contexts.append(context)
