"""OpenAI's request and response shapes: a request body becomes a :class:`Job` (token ids + sampling),
a finished job becomes the response body. No HTTP here, no engine: plain data, tested on its own.

What a request may ask (anything else is refused with one JSON error naming the field):

- chat (``/v1/chat/completions``): ``messages`` (``content`` a string or a list of text parts; ``assistant``
  messages with ``tool_calls``, ``tool`` messages with results), ``tools`` and ``tool_choice`` auto/none
  (the model's hermes ``<tool_call>`` blocks become ``tool_calls``: `posttrain.serve.chat_tools`), ``model``,
  ``temperature`` (0-2), ``top_p`` (0-1], ``top_k`` (vLLM's extension), ``max_tokens`` /
  ``max_completion_tokens``, ``n``, ``stop`` (a string or up to 4), ``seed``, ``logprobs`` (bool),
  ``top_logprobs`` 0, ``stream``, ``stream_options``; ``user``/``metadata``/``store``/``service_tier`` are ignored.
- completions (``/v1/completions``): ``prompt`` (a string, a list of strings, a list of token ids or a
  list of such lists), the same sampling fields, ``logprobs`` 0 (the sampled tokens' log-probs).
- ``return_token_ids`` (vLLM's extension): token ids in the response without log-probs.

When ``logprobs`` is asked (or ``return_token_ids``), the response carries the ids as vLLM does:
``prompt_token_ids`` on the response (completions: on each choice) and ``token_ids`` on each choice,
the EOS token included when the model ended with it (that token's text is not in ``content``).
Log-probs are the engine's ``rollout_log_probs``: ``log_softmax(logits / temperature)`` of each
sampled token (temperature 1 when greedy), the quantity a trainer recomputes.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from posttrain.serve import chat_tools
from posttrain.serve.errors import ServeError

__all__ = ["Job", "Choice", "ServeError", "parse_chat", "parse_completion", "chat_response", "completion_response",
           "chat_stream_events", "completion_stream_events", "error_body", "apply_stop"]

MAX_N = 64
MAX_STOP = 4
IGNORED = {"user", "metadata", "store", "service_tier", "stream_options", "model", "stream", "return_token_ids"}
SAMPLING = {"temperature", "top_p", "top_k", "max_tokens", "n", "stop", "seed", "logprobs"}
CHAT_FIELDS = IGNORED | SAMPLING | {"messages", "max_completion_tokens", "top_logprobs", "parallel_tool_calls", "tools",
                                    "tool_choice"}
COMPLETION_FIELDS = IGNORED | SAMPLING | {"prompt", "echo", "best_of", "suffix"}
# fields that are part of OpenAI's API but change what is generated in ways this server does not do
UNSUPPORTED = {
    "functions": "function calling (send 'tools')",
    "function_call": "function calling (send 'tool_choice')", "response_format": "structured output (response_format)",
    "logit_bias": "logit_bias", "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty", "audio": "audio output", "modalities": "audio output",
    "prediction": "predicted outputs", "reasoning_effort": "reasoning_effort", "web_search_options": "web search",
}


def error_body(error: ServeError) -> dict:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": str(error), "type": error.kind, "param": error.param, "code": error.code}}


@dataclass
class Job:
    """One request, ready for the engine: ``prompts`` token-id lists (one per prompt; chat has one)
    and how to sample them. ``n`` samples are drawn per prompt."""

    kind: str  # "chat" or "completion"
    prompts: list[list[int]]
    model: str
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    token_ids: bool = False
    stream: bool = False
    include_usage: bool = False
    tools: list[dict] | None = None
    """The request's tools (chat): the replies' ``<tool_call>`` blocks become ``tool_calls``."""
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def group_key(self) -> tuple:
        """Jobs with equal keys decode in one engine call (the engine takes one sampling setting a call).
        A seeded job decodes alone under its own generator, so its draws do not depend on other traffic."""
        if self.seed is not None:
            return ("seed", self.id)
        if self.greedy:
            return ("greedy",)
        return ("sample", self.temperature, self.top_p, self.top_k)


@dataclass
class Choice:
    """One generated sequence: its token ids (EOS included when it ended there), their log-probs,
    the text (stop string and EOS cut), and why it ended (``stop`` or ``length``)."""

    token_ids: list[int]
    log_probs: list[float]
    text: str
    finish_reason: str


# ---------------------------------------------------------------------------------------- parsing


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ServeError(f"'{name}' must be a number, got {value!r}", param=name)
    if value > hi or value < lo or (lo_open and value == lo):
        raise ServeError(f"'{name}' must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value!r}", param=name)
    return float(value)


def _integer(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ServeError(f"'{name}' must be an integer, got {value!r}", param=name)
    if value < lo or (hi is not None and value > hi):
        raise ServeError(f"'{name}' must be in [{lo}, {hi if hi is not None else 'inf'}], got {value}", param=name)
    return value


def _harmless(name: str, value: Any) -> bool:
    """An unsupported field sent with a value that asks for nothing (a zero penalty, no tools, plain text)."""
    if name == "response_format":
        return value is None or value == {"type": "text"}
    return value is None or (not isinstance(value, bool) and value in ([], {}, 0))


def _check_fields(body: Any, allowed: set[str], endpoint: str) -> None:
    if not isinstance(body, dict):
        raise ServeError("the request body must be a JSON object")
    for name, what in UNSUPPORTED.items():
        if name not in body or _harmless(name, body[name]):
            continue
        raise ServeError(f"'{name}': {what} is not supported by posttrain serve", param=name,
                             code="unsupported_parameter")
    unknown = sorted(k for k in body if k not in allowed and k not in UNSUPPORTED)
    if unknown:
        raise ServeError(f"unknown field(s) {unknown} for {endpoint}; posttrain serve accepts: "
                         f"{sorted(allowed - {'parallel_tool_calls'})}", param=unknown[0], code="unsupported_parameter")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise ServeError(f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them, got {stop!r}",
                         param="stop")
    return stops


def _sampling(body: dict, job: Job) -> Job:
    job.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    job.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _integer(body, "top_k", -1)
    job.top_k = -1 if top_k in (None, 0) else top_k
    job.n = _integer(body, "n", 1, MAX_N) or 1
    job.stop = _stop(body)
    job.seed = _integer(body, "seed", -(2 ** 63), 2 ** 63 - 1)
    job.stream = bool(body.get("stream") or False)
    options = body.get("stream_options") or {}
    job.include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    job.token_ids = bool(body.get("return_token_ids") or False)
    return job


def _max_tokens(body: dict, *names: str) -> int | None:
    values = [(n, _integer(body, n, 1)) for n in names if body.get(n) is not None]
    return values[0][1] if values else None


def chat_messages(body: dict) -> list[dict]:
    """The request's messages as ``{"role", "content"}`` dicts with text content (plus an assistant's
    ``tool_calls`` and a tool message's ``tool_call_id``: `posttrain.serve.chat_tools`), checked."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ServeError("'messages' must be a non-empty list", param="messages")
    return [chat_tools.message_of(m, i) for i, m in enumerate(messages)]


def parse_chat(body: Any, tokenizer: Any, render: Any = None) -> Job:
    """A ``/v1/chat/completions`` body -> :class:`Job` (the model's chat template applied, with the
    request's ``tools``). ``render(messages, tools) -> ids`` replaces the template (a server that keeps
    each conversation's tokens: `posttrain.agents.sessions`)."""
    _check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    messages = chat_messages(body)
    tools = chat_tools.check_tools(body)
    parse_calls = chat_tools.check_tool_choice(body, tools)
    if body.get("top_logprobs"):
        raise ServeError("'top_logprobs' > 0 (alternatives to each sampled token) is not supported; logprobs=true "
                         "returns each sampled token's log-prob and id", param="top_logprobs",
                         code="unsupported_parameter")
    ids = render(messages, tools) if render is not None else chat_tools.render_prompt(tokenizer, messages, tools)
    job = Job("chat", [list(ids)], str(body.get("model") or ""), _max_tokens(body, "max_completion_tokens",
                                                                               "max_tokens"))
    job.logprobs = bool(body.get("logprobs") or False)
    job.tools = tools if parse_calls else None
    return _sampling(body, job)


def _prompts(prompt: Any, tokenizer: Any) -> list[list[int]]:
    def ids_of(p: Any) -> list[int]:
        if isinstance(p, str):
            return list(tokenizer(p, add_special_tokens=False)["input_ids"])
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return list(p)
        raise ServeError("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
                         param="prompt")

    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        out = [ids_of(p) for p in prompt]
    else:
        out = [ids_of(prompt)]
    vocab = len(tokenizer)
    for p in out:
        if not p:
            raise ServeError("a prompt is empty", param="prompt")
        if any(t < 0 or t >= vocab for t in p):
            raise ServeError(f"a prompt token id is outside the vocabulary [0, {vocab})", param="prompt")
    return out


def parse_completion(body: Any, tokenizer: Any) -> Job:
    """A ``/v1/completions`` body -> :class:`Job`."""
    _check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    if body.get("echo"):
        raise ServeError("'echo' is not supported", param="echo", code="unsupported_parameter")
    if body.get("suffix"):
        raise ServeError("'suffix' (insertion) is not supported", param="suffix", code="unsupported_parameter")
    if "prompt" not in body:
        raise ServeError("'prompt' is required", param="prompt")
    logprobs = _integer(body, "logprobs", 0, 20)
    if logprobs:
        raise ServeError(f"logprobs={logprobs}: alternatives to each sampled token are not supported; logprobs=0 "
                         "returns each sampled token's log-prob and id", param="logprobs", code="unsupported_parameter")
    job = Job("completion", _prompts(body["prompt"], tokenizer), str(body.get("model") or ""),
              _max_tokens(body, "max_tokens"))
    job.logprobs = logprobs is not None
    job = _sampling(body, job)
    best_of = _integer(body, "best_of", 1)
    if best_of is not None and best_of != job.n:
        raise ServeError("'best_of' other than n is not supported", param="best_of", code="unsupported_parameter")
    return job


# ------------------------------------------------------------------------------------ generation


def apply_stop(ids: list[int], log_probs: list[float], ended_on_eos: bool, stops: list[str], tokenizer: Any
               ) -> Choice:
    """A :class:`Choice` from a generated row (``ids`` up to and including EOS when ``ended_on_eos``).

    A stop string ends the text before it; the ids keep the tokens up to the one that completed it
    (as vLLM's do): the shortest prefix whose text contains the stop string."""
    body = ids[:-1] if ended_on_eos else ids
    text = tokenizer.decode(body, skip_special_tokens=True)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return Choice(list(ids), list(log_probs), text, "stop" if ended_on_eos else "length")
    cut, _ = min(hits)
    for k in range(1, len(body) + 1):  # the shortest prefix of tokens whose text reaches past the stop's start
        part = tokenizer.decode(body[:k], skip_special_tokens=True)
        if any(s in part for s in stops):
            break
    return Choice(list(body[:k]), list(log_probs[:k]), text[:cut], "stop")


# ------------------------------------------------------------------------------------- responses


def _usage(job: Job, choices: list[list[Choice]]) -> dict:
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(c.token_ids) for row in choices for c in row)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token])


def _chat_logprobs(choice: Choice, tokenizer: Any) -> dict:
    content = []
    for token, lp in zip(choice.token_ids, choice.log_probs):
        text = _token_text(tokenizer, token)
        content.append({"token": text, "logprob": float(lp), "bytes": list(text.encode("utf-8")), "top_logprobs": []})
    return {"content": content}


def chat_response(job: Job, choices: list[list[Choice]], tokenizer: Any) -> dict:
    """The ``chat.completion`` object (``choices[0]``: one prompt, ``n`` choices)."""
    out = []
    for i, c in enumerate(choices[0]):
        message, _ = chat_tools.reply_message(c.text, job.tools, job.id, i)
        finish = "tool_calls" if message.get("tool_calls") and c.finish_reason == "stop" else c.finish_reason
        entry: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
        if job.logprobs:
            entry["logprobs"] = _chat_logprobs(c, tokenizer)
        if job.logprobs or job.token_ids:
            entry["token_ids"] = list(c.token_ids)
        out.append(entry)
    body = {"id": f"chatcmpl-{job.id}", "object": "chat.completion", "created": job.created, "model": job.model,
            "choices": out, "usage": _usage(job, choices)}
    if job.logprobs or job.token_ids:
        body["prompt_token_ids"] = list(job.prompts[0])
    return body


def _completion_logprobs(choice: Choice, tokenizer: Any) -> dict:
    tokens = [_token_text(tokenizer, t) for t in choice.token_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [float(x) for x in choice.log_probs], "top_logprobs": None,
            "text_offset": offsets}


def completion_response(job: Job, choices: list[list[Choice]], tokenizer: Any) -> dict:
    """The ``text_completion`` object: ``n`` choices per prompt, prompt by prompt (OpenAI's order)."""
    out = []
    for p, row in enumerate(choices):
        for c in row:
            entry: dict[str, Any] = {"index": len(out), "text": c.text, "finish_reason": c.finish_reason,
                                     "logprobs": _completion_logprobs(c, tokenizer) if job.logprobs else None}
            if job.logprobs or job.token_ids:
                entry["token_ids"] = list(c.token_ids)
                entry["prompt_token_ids"] = list(job.prompts[p])
            out.append(entry)
    return {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created, "model": job.model,
            "choices": out, "usage": _usage(job, choices)}


def chat_stream_events(job: Job, choices: list[list[Choice]], tokenizer: Any) -> list[dict]:
    """``chat.completion.chunk`` objects for ``stream=true``: per choice a role chunk, one content chunk
    (the engine returns whole sequences, so the text arrives at once) and a finish chunk; then the usage
    chunk when ``stream_options.include_usage``."""
    full = chat_response(job, choices, tokenizer)
    base = {"id": full["id"], "object": "chat.completion.chunk", "created": job.created, "model": job.model}
    events = []
    for entry in full["choices"]:
        i = entry["index"]
        events.append({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        delta = {"content": entry["message"]["content"]}
        if entry["message"].get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(entry["message"]["tool_calls"])]
        content = {"index": i, "delta": delta, "logprobs": entry["logprobs"], "finish_reason": None}
        if "token_ids" in entry:
            content["token_ids"] = entry["token_ids"]
        events.append({**base, "choices": [content]})
        events.append({**base, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                            "finish_reason": entry["finish_reason"]}]})
    if job.include_usage:
        events.append({**base, "choices": [], "usage": full["usage"]})
    return events


def completion_stream_events(job: Job, choices: list[list[Choice]], tokenizer: Any) -> list[dict]:
    """``text_completion`` chunks for ``stream=true``: per choice its text, then its finish reason."""
    full = completion_response(job, choices, tokenizer)
    base = {"id": full["id"], "object": "text_completion", "created": job.created, "model": job.model}
    events = []
    for entry in full["choices"]:
        events.append({**base, "choices": [{**entry, "finish_reason": None}]})
        events.append({**base, "choices": [{"index": entry["index"], "text": "", "logprobs": None,
                                            "finish_reason": entry["finish_reason"]}]})
    if job.include_usage:
        events.append({**base, "choices": [], "usage": full["usage"]})
    return events
