"""Tool calling in OpenAI's chat format, over a model that writes hermes-style calls.

- A request's ``tools`` (OpenAI function schemas) reach the chat template as ``tools=`` (a template that
  renders them, Qwen's, shows them to the model; one that does not, SmolLM2's, ignores them, and the
  prompt's own text must describe the tools, as the built-in tool task's system message does).
- The model's reply text is parsed with `posttrain.rollout.tool_parser` (``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``): each block that is a valid call of an offered tool becomes an
  OpenAI ``tool_calls`` entry (``arguments`` a JSON string) and leaves the ``content``; a block that is not
  (bad JSON, an unknown tool, arguments outside the schema) stays in ``content`` as text, as the
  model wrote it, and is counted as invalid. ``finish_reason`` is ``tool_calls`` when there is a call.
- History sent back (an ``assistant`` message with ``tool_calls``, ``tool`` messages with the results) is
  rendered for the template as the multi-turn loop renders it (`posttrain.rollout.multi_turn`): a template
  that knows ``tool_calls`` gets them (arguments as a dict); one that does not gets the calls written back
  as ``<tool_call>`` text after the content. A template with a ``tool`` role gets ``tool`` messages; one
  without gets each run of tool messages as one ``user`` message of ``<tool_response>`` blocks.

:func:`render_after` renders messages that follow an assistant turn whose tokens are already known (the
text the template puts after an assistant message, the new messages, the generation prompt), so a
server that keeps a conversation's tokens appends only the new turns (`posttrain.agents.sessions`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from posttrain.rollout.tool_parser import ToolCall, parse_tool_calls
from posttrain.errors import ConfigError
from posttrain.serve.errors import ServeError
from posttrain.tools.schemas import OpenAIFunctionToolSchema, check_tool_schema

__all__ = ["TemplateForm", "check_tools", "check_tool_choice", "message_of", "template_messages", "render_prompt",
           "render_after", "split_tool_calls", "reply_message", "message_key", "call_id"]

_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.S)
_SENTINEL = "\u2063posttrain-turn-end\u2063"


@dataclass(frozen=True)
class TemplateForm:
    """What a chat template renders itself (read from its text)."""

    tools: bool
    tool_calls: bool
    tool_role: bool

    @classmethod
    def of(cls, tokenizer: Any) -> "TemplateForm":
        text = getattr(tokenizer, "chat_template", None) or ""
        text = text if isinstance(text, str) else json.dumps(text)
        return cls(tools="tools" in text, tool_calls="tool_calls" in text,
                   tool_role="tool" in text.replace("tool_calls", "").replace("tools", ""))


def check_tools(body: dict) -> list[dict] | None:
    """The request's ``tools`` (a list of OpenAI function schemas), checked; None when absent or empty."""
    tools = body.get("tools")
    if tools in (None, []):
        return None
    if not isinstance(tools, list):
        raise ServeError("'tools' must be a list of {type: function, function: {name, description, parameters}}",
                         param="tools")
    names = set()
    for i, tool in enumerate(tools):
        try:
            check_tool_schema(tool, f"tools[{i}]")
        except ConfigError as err:
            raise ServeError(str(err), param=f"tools[{i}]") from None
        name = tool["function"]["name"]
        if name in names:
            raise ServeError(f"tools[{i}]: the tool name {name!r} is given twice", param=f"tools[{i}]")
        names.add(name)
    return [dict(t) for t in tools]


def check_tool_choice(body: dict, tools: list[dict] | None) -> bool:
    """Whether the reply's calls are parsed: ``tool_choice`` auto (the default with tools) or none."""
    choice = body.get("tool_choice")
    if choice in (None, "auto"):
        return tools is not None
    if choice == "none":
        return False
    raise ServeError(f"'tool_choice'={choice!r}: only 'auto' and 'none' are supported (the model decides whether "
                     "it calls a tool; forcing a call needs constrained decoding)", param="tool_choice",
                     code="unsupported_parameter")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ServeError(f"{where}: only text parts are supported, got {kind!r}", param=where,
                                 code="unsupported_parameter")
            parts.append(part["text"])
        return "".join(parts)
    raise ServeError(f"{where} must be a string or a list of text parts", param=where)


def _calls(value: Any, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise ServeError(f"{where} must be a list", param=where)
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ServeError(f"{where}[{j}] must be {{id, type: function, function: {{name, arguments}}}}", param=where)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as err:
                raise ServeError(f"{where}[{j}].function.arguments is not JSON: {err.msg}", param=where) from None
        out.append({"id": str(call.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def message_of(m: Any, i: int) -> dict:
    """One request message as ``{"role", "content"}`` (text), plus ``tool_calls`` (arguments decoded)
    on an assistant message and ``tool_call_id`` on a tool message."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ServeError(f"{where} must be an object with a 'role'", param="messages")
    out = {"role": m["role"], "content": _text(m.get("content"), f"{where}.content")}
    if m.get("tool_calls"):
        if m["role"] != "assistant":
            raise ServeError(f"{where}: only assistant messages carry tool_calls", param="messages")
        out["tool_calls"] = _calls(m["tool_calls"], f"{where}.tool_calls")
    if m["role"] == "tool" and m.get("tool_call_id") is not None:
        out["tool_call_id"] = str(m["tool_call_id"])
    return out


def _call_text(call: dict) -> str:
    fn = call["function"]
    return "<tool_call>" + json.dumps({"name": fn["name"], "arguments": fn["arguments"]}) + "</tool_call>"


def template_messages(messages: list[dict], form: TemplateForm) -> list[dict]:
    """``messages`` as the template receives them (module docstring)."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls") and not form.tool_calls:
            text = "\n".join([m["content"]] * bool(m["content"]) + [_call_text(c) for c in m["tool_calls"]])
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool" and not form.tool_role:
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tools"):  # a run of tool results: one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tools": True})
        else:
            out.append(dict(m))
    return [{k: v for k, v in m.items() if k != "_tools"} for m in out]


def _apply(tokenizer: Any, messages: list[dict], tools: list[dict] | None, form: TemplateForm) -> str:
    kwargs = {"tools": tools} if tools and form.tools else {}
    try:
        return tokenizer.apply_chat_template(template_messages(messages, form), add_generation_prompt=True,
                                             tokenize=False, **kwargs)
    except Exception as err:  # the template's own checks (roles out of order, ...)
        raise ServeError(f"the model's chat template refused these messages: {err}", param="messages") from None


def render_prompt(tokenizer: Any, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The whole conversation through the chat template, with the generation prompt: token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise ServeError("this model has no chat template; send the prompt text to /v1/completions instead",
                         param="messages")
    text = _apply(tokenizer, messages, tools, TemplateForm.of(tokenizer))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_after(tokenizer: Any, messages: list[dict], tools: list[dict] | None, last_token: int) -> list[int]:
    """Token ids of ``messages`` following an assistant turn whose last token was ``last_token``: the
    template's text after an assistant message (less the end-of-turn token the model already wrote), the
    messages, the generation prompt."""
    form = TemplateForm.of(tokenizer)
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
    full = _apply(tokenizer, base + messages, tools, form)
    if _SENTINEL not in full:
        raise ServeError("the chat template does not render an assistant message's content", param="messages")
    text = full[full.index(_SENTINEL) + len(_SENTINEL):]
    emitted = tokenizer.decode([last_token])
    if emitted and text.startswith(emitted):
        text = text[len(emitted):]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def call_id(job_id: str, choice: int, k: int) -> str:
    """A tool call's id: fixed by the request, the choice and the call's place (the recorder and the
    response agree on it)."""
    return f"call_{job_id[:12]}_{choice}_{k}"


def split_tool_calls(text: str, tools: list[dict] | None) -> tuple[str, list[ToolCall], int]:
    """``(content, valid calls, invalid blocks)`` of a reply's text (module docstring)."""
    if not tools or "<tool_call>" not in text:
        return text, [], 0
    schemas = {t["function"]["name"]: OpenAIFunctionToolSchema(t) for t in tools}
    calls, invalid, kept, at = [], 0, [], 0
    for m in _BLOCK.finditer(text):
        parsed = parse_tool_calls(m.group(0), schemas)
        if len(parsed) == 1 and isinstance(parsed[0], ToolCall):
            calls.append(parsed[0])
            kept.append(text[at:m.start()])
            at = m.end()
        else:
            invalid += 1
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return content, calls, invalid


def reply_message(text: str, tools: list[dict] | None, job_id: str, choice: int) -> tuple[dict, int]:
    """The assistant message of a reply (``content`` None when only calls) and its invalid blocks."""
    content, calls, invalid = split_tool_calls(text, tools)
    message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
    if calls:
        message["tool_calls"] = [{"id": call_id(job_id, choice, k), "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                 for k, c in enumerate(calls)]
    return message, invalid


def message_key(m: dict) -> tuple:
    """What identifies a message when a client sends history back: role, text (outer whitespace aside),
    calls by name and arguments (their ids aside)."""
    calls = tuple((c["function"]["name"], json.dumps(_decoded(c["function"]["arguments"]), sort_keys=True))
                  for c in m.get("tool_calls") or ())
    return m["role"], (m.get("content") or "").strip(), calls


def _decoded(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args
