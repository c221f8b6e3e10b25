"""Multi-turn rollouts (verl's ``tool_agent`` loop): the model may call tools, or an interaction may
answer it, between its turns; the trajectory is token-in, token-out.

One call of :meth:`MultiTurnRollout.generate` drives all rows of a batch together: every turn, the
engine generates for all rows still running (each row's context is its prompt plus everything after
it so far, left-padded, so rows at different turns generate in one batch); then each row's text is
parsed for tool calls (``posttrain.rollout.tool_parser``), the calls of all rows run concurrently
(at most ``multi_turn.max_parallel_calls`` at once, each with a time-out), and their answers are
appended as a tool turn. A row stops when its turn calls no tool (and no interaction asks for more),
at ``max_assistant_turns`` / ``max_user_turns``, or when the next turn would not fit in
``rollout.response_length`` (a trajectory never ends on a tool or user turn, as in verl).

Token-in, token-out: the recorded trajectory is the model's sampled token ids plus the token ids of
the tool/user turns, concatenated; it is never re-rendered through the chat template (which can
tokenize differently and breaks training). ``response_mask`` is 1 on the model's tokens and 0 on
tool/user tokens; ``rollout_log_probs`` are the engine's on model tokens, 0 elsewhere.

Tool and user turns are rendered with the tokenizer's chat template: the text the template puts
after an assistant message (minus the end-of-turn token the model already emitted), the new
message(s), and the generation prompt. A template that knows a ``tool`` role (its text mentions
``tool``) gets one ``tool`` message per call; one that does not (SmolLM2's, which renders any role
name verbatim and was not trained on ``tool``) gets verl's Qwen-style user turn with one
``<tool_response>...</tool_response>`` block per call.

Failing calls (bad JSON, unknown tool, wrong arguments, a tool that raises or passes its time-out)
become an ``Error: ...`` tool answer the model reads, and are counted as tool errors; never a crash.

User code (every method of a tool or an interaction) runs in a daemon thread of its own
(``posttrain.tools.user_code``) under a time-out: ``tool_timeout_s`` for tools, ``interaction_timeout_s``
for interactions. A call that blocks (``time.sleep`` in an ``async`` method) or never returns is
abandoned at its time-out and cannot stall the loop or keep the process alive. A tool's ``calc_reward``
or ``release`` that raises, times out or returns a non-finite reward is counted in
``multi_turn/tool_finish_errors`` (the reward is left out); an interaction method that does is counted in
``multi_turn/interaction_errors`` (and ``interaction_timeouts``): a failed ``start_interaction`` leaves the
trajectory without its interaction, a failed ``generate_response`` ends it on the model's turn, a failed
``calculate_score`` leaves its score 0. Each is logged; none ends the run.

Guards (off by default): ``max_consecutive_invalid_tool_calls`` ends a trajectory whose invalid calls
(bad JSON, unknown tool, wrong arguments; a tool's ``invalid_tool_call`` metric) reach that many in a
row, before their error turn is appended (verl's guard: a valid call resets the count, a tool that
fails does not count). ``filter_void_turns`` gives a trajectory with a void turn (an assistant turn
that calls no tool and gives no final answer: blank, or not matching ``final_answer_pattern``;
SimpleTIR) zero loss weight: its ``response_mask`` becomes all 0, as the trainer's padding rows are.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import torch

from posttrain.batch import Batch
from posttrain.errors import DataError
from posttrain.rollout.base import SamplingParams, with_uids
from posttrain.rollout.tool_parser import ToolCall, ToolCallError, parse_tool_calls
from posttrain.tools.base_tool import BaseTool
from posttrain.tools.schemas import ToolResponse
from posttrain.tools.user_code import UserCodeTimeout, abandoned_calls, run_user_code

__all__ = ["MultiTurnRollout", "ToolTurnRenderer", "truncate_text", "multi_turn_columns", "multi_turn_rewards",
           "METRIC_COLUMNS"]

logger = logging.getLogger(__name__)

# The limits a sandbox reports ending a run (a tool's ``sandbox_kill`` metric; any other cause counts as killed).
KILL_CAUSES = ("timeout", "cpu", "memory", "file_size", "processes", "output", "killed")
METRIC_COLUMNS = ("multi_turn/turns", "multi_turn/assistant_turns", "multi_turn/tool_calls", "multi_turn/tool_errors",
                  "multi_turn/valid_tool_calls", "multi_turn/invalid_tool_calls", "multi_turn/tool_timeouts",
                  *(f"multi_turn/sandbox_kills/{cause}" for cause in KILL_CAUSES),
                  "multi_turn/hit_turn_limit", "multi_turn/hit_length_limit", "multi_turn/hit_invalid_call_limit",
                  "multi_turn/void_turns", "multi_turn/void_filtered", "multi_turn/tool_finish_errors",
                  "multi_turn/interaction_errors", "multi_turn/interaction_timeouts")
REWARD_COLUMNS = ("multi_turn/tool_reward", "multi_turn/interaction_score")
TOOL_CALL_RATE = "multi_turn/tool_call_rate"
"""Where tools are offered: 1 per response that called one; the step's mean is the tool-call rate."""
_SENTINEL = "\u2063posttrain-turn-end\u2063"
# Interaction and end-of-trajectory calls running at once (each is a thread with its own event loop, three
# file descriptors): enough for any batch to proceed, few enough that a large one cannot exhaust the fds.
LIFECYCLE_PARALLEL = 64


def truncate_text(text: str, limit: int, side: str) -> str:
    """``text`` cut to ``limit`` characters (verl's rule): ``left`` keeps the start, ``right`` the end,
    ``middle`` both halves, each with a ``(truncated)`` marker where text was removed."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + (text[-half:] if half else "")


class ToolTurnRenderer:
    """Token ids of a tool or user turn that follows an assistant turn (module docstring)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.has_template = bool(template)
        self.tool_role = bool(template) and "tool" in template

    def tool_turn(self, answers: Sequence[str], last_token: int) -> list[int]:
        if self.tool_role:
            return self._render([{"role": "tool", "content": a} for a in answers], last_token)
        body = "\n".join(f"<tool_response>\n{a}\n</tool_response>" for a in answers)
        return self._render([{"role": "user", "content": body}], last_token)

    def user_turn(self, text: str, last_token: int) -> list[int]:
        return self._render([{"role": "user", "content": text}], last_token)

    def _render(self, messages: list[dict], last_token: int) -> list[int]:
        if not self.has_template:  # no chat template: the messages' text on their own lines
            text = "\n" + "\n".join(m["content"] for m in messages) + "\n"
        else:
            base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
            full = self.tokenizer.apply_chat_template(base + messages, tokenize=False, add_generation_prompt=True)
            text = full[full.index(_SENTINEL) + len(_SENTINEL):]
            emitted = self.tokenizer.decode([last_token])  # the end-of-turn token the model produced
            if emitted and text.startswith(emitted):
                text = text[len(emitted):]
        return list(self.tokenizer.encode(text, add_special_tokens=False))


@dataclass
class _Trajectory:
    """One row's conversation after its prompt, and its counts."""

    prompt: list[int]
    agent: str
    tools_kwargs: dict
    messages: list[dict]
    interaction: Any = None
    interaction_kwargs: dict = field(default_factory=dict)
    interaction_id: str | None = None
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    last_turn: list[int] = field(default_factory=list)
    instances: dict[str, str] = field(default_factory=dict)  # tool name -> instance id
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    invalid_calls: int = 0
    consecutive_invalid: int = 0
    tool_timeouts: int = 0
    sandbox_kills: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KILL_CAUSES, 0))
    void_turns: int = 0
    hit_turn_limit: bool = False
    hit_length_limit: bool = False
    hit_invalid_call_limit: bool = False
    tool_finish_errors: int = 0
    interaction_errors: int = 0
    interaction_timeouts: int = 0
    tool_reward: float = 0.0
    interaction_score: float = 0.0
    done: bool = False
    create_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one create() per tool and trajectory


class MultiTurnRollout:
    """The agent loop over an engine (``generate(Batch, SamplingParams)``; the hf engine here).

    Args:
        engine: the rollout engine.
        tokenizer: decodes turns and renders tool/user turns.
        config: ``actor_rollout_ref.rollout.multi_turn``.
        tools: the tools (``posttrain.tools.build_tools`` / ``load_tools_config``).
        interactions: ``{name: interaction}``.
        default_agent: ``rollout.agent.default_agent_loop`` for rows without ``agent_name``.
    """

    def __init__(self, engine: Any, tokenizer: Any, config: Any, tools: Sequence[BaseTool] = (),
                 interactions: dict[str, Any] | None = None, default_agent: str = "tool_agent"):
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.tools = {t.name: t for t in tools}
        self.schemas = {name: t.tool_schema for name, t in self.tools.items()}
        self.interactions = dict(interactions or {})
        self.default_agent = default_agent
        self.renderer = ToolTurnRenderer(tokenizer)
        self.final_answer = re.compile(config.final_answer_pattern) if config.final_answer_pattern else None
        self.pad_token_id = getattr(engine, "pad_token_id", None)
        if self.pad_token_id is None:
            self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @classmethod
    def from_config(cls, engine: Any, tokenizer: Any, rollout_config: Any, extra_tools: Sequence[Any] = ()):
        """Tools from ``multi_turn.tool_config_path`` plus ``extra_tools``; interactions from
        ``multi_turn.interaction_config_path``."""
        from posttrain.interactions.registry import load_interaction_config
        from posttrain.tools.registry import build_tools, load_tools_config

        mt = rollout_config.multi_turn
        tools = load_tools_config(mt.tool_config_path) if mt.tool_config_path else []
        tools = build_tools([*tools, *extra_tools], "multi_turn tools")
        interactions = load_interaction_config(mt.interaction_config_path) if mt.interaction_config_path else {}
        return cls(engine, tokenizer, mt, tools, interactions, rollout_config.agent.default_agent_loop)

    # ------------------------------------------------------------------ the loop
    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """``N`` prompts -> ``N * sampling.n`` trajectories (keys of ``posttrain.rollout.base`` plus
        the per-row ``multi_turn/*`` columns)."""
        prompts = with_uids(prompts)  # the n trajectories of a prompt share its uid, as the engines' outputs do
        rows = prompts.repeat(sampling.n, interleave=True) if sampling.n > 1 else prompts
        trajs = [self._start(rows, i) for i in range(len(rows))]
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._run(trajs, replace(sampling, n=1)))
        finally:
            loop.close()
        return self._assemble(rows, trajs, sampling)

    def _start(self, rows: Batch, i: int) -> _Trajectory:
        prompt = rows["input_ids"][i][rows["attention_mask"][i].bool()].tolist()
        extra = _row_field(rows, "extra_info", i) or {}
        agent = _row_field(rows, "agent_name", i) or self.default_agent
        raw = _row_field(rows, "raw_prompt", i)
        traj = _Trajectory(prompt, agent, dict(extra.get("tools_kwargs") or {}), list(raw) if raw is not None else [])
        kwargs = extra.get("interaction_kwargs")
        if kwargs and agent != "single_turn_agent" and self.interactions:
            name = kwargs.get("name") or next(iter(self.interactions))
            if name not in self.interactions:
                raise DataError(f"row {i}: extra_info.interaction_kwargs.name={name!r} is not configured "
                               f"(multi_turn.interaction_config_path names {sorted(self.interactions)})")
            traj.interaction, traj.interaction_kwargs = self.interactions[name], dict(kwargs)
        return traj

    async def _run(self, trajs: list[_Trajectory], sampling: SamplingParams) -> None:
        self._lifecycle = asyncio.Semaphore(LIFECYCLE_PARALLEL)  # of this loop
        await asyncio.gather(*(self._start_interaction(t) for t in trajs if t.interaction is not None))
        limit = asyncio.Semaphore(max(1, int(self.config.max_parallel_calls)))
        try:
            while active := [t for t in trajs if not t.done]:
                self._generate_turn(active, sampling)
                await asyncio.gather(*(self._after_turn(t, sampling.response_length, limit) for t in active))
        finally:
            await asyncio.gather(*(self._finish(t) for t in trajs))

    @staticmethod
    def _interaction_kwargs(t: _Trajectory) -> dict:
        return t.interaction_kwargs

    async def _start_interaction(self, t: _Trajectory) -> None:
        """``start_interaction``; when it fails (counted) the trajectory goes on without its interaction."""
        kwargs = {k: v for k, v in self._interaction_kwargs(t).items() if k != "name"}
        ok, instance_id = await self._interaction_call(t, "start_interaction", None, **kwargs)
        if ok:
            t.interaction_id = instance_id
        else:
            t.interaction = None

    async def _interaction_call(self, t: _Trajectory, method: str, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        """``(True, result)`` of one interaction method, or ``(False, None)`` when it raised or passed
        ``interaction_timeout_s`` (counted in the trajectory's interaction errors, and logged)."""
        timeout = float(self.config.interaction_timeout_s)
        what = f"interaction {getattr(t.interaction, 'name', type(t.interaction).__name__)}.{method}"
        try:
            call = functools.partial(getattr(t.interaction, method), *args, **kwargs)
            async with self._lifecycle:
                return True, await run_user_code(call, timeout=timeout, what=what)
        except UserCodeTimeout:
            t.interaction_timeouts += 1
            _log_abandoned(what, timeout, "interaction_timeout_s")
        except Exception as err:  # the interaction's bug ends its part of this trajectory, not the run
            logger.warning("%s raised %s: %s", what, type(err).__name__, err)
        t.interaction_errors += 1
        return False, None

    async def _interaction_reply(self, t: _Trajectory) -> tuple[bool, str] | None:
        """``(should_terminate, reply text)`` after the model's turn; None when the interaction failed."""
        ok, out = await self._interaction_call(t, "generate_response", t.interaction_id, t.messages,
                                               **self._interaction_kwargs(t))
        if not ok:
            return None
        if not (isinstance(out, (tuple, list)) and len(out) == 4 and isinstance(out[1], str)):
            logger.warning("interaction %s.generate_response returned %.200r; expected (should_terminate, "
                           "response_text, turn_score, metadata)", getattr(t.interaction, "name", "?"), out)
            t.interaction_errors += 1
            return None
        return bool(out[0]), _valid_text(out[1])

    def _generate_turn(self, active: list[_Trajectory], sampling: SamplingParams) -> None:
        """One assistant turn for every active row, in one engine call."""
        budget = [sampling.response_length - len(t.tokens) for t in active]
        batch = _left_padded([t.prompt + t.tokens for t in active], self.pad_token_id)
        out = self.engine.generate(batch, replace(sampling, response_length=max(budget)))
        lengths = out["response_mask"].sum(-1).tolist()
        lps = out["rollout_log_probs"] if "rollout_log_probs" in out else torch.zeros(out["responses"].shape)
        for k, t in enumerate(active):
            n = min(int(lengths[k]), budget[k])
            t.last_turn = out["responses"][k, :n].tolist()
            t.tokens += t.last_turn
            t.mask += [1] * n
            t.log_probs += lps[k, :n].float().tolist()
            t.assistant_turns += 1

    async def _after_turn(self, t: _Trajectory, response_length: int, limit: asyncio.Semaphore) -> None:
        """Decide whether ``t`` goes on; if so append its tool or user turn (mask 0).

        At ``max_assistant_turns`` / ``max_user_turns`` a turn's tool calls are not run; an
        interaction still judges the turn (so its score covers the last answer), then the row stops.
        """
        text = self.tokenizer.decode(t.last_turn, skip_special_tokens=True)
        t.messages.append({"role": "assistant", "content": text})
        if len(t.tokens) >= response_length:
            t.hit_length_limit, t.done = True, True
            return
        calls = parse_tool_calls(text, self.schemas, self.config.format) if t.agent == "tool_agent" and self.tools else []
        at_limit = self._at_turn_limit(t)
        t.void_turns += int(not calls and self._is_void(text))
        if calls and not at_limit:
            answers, invalid = zip(*await asyncio.gather(*(self._call(t, c, limit) for c in calls)))
            if self._past_invalid_call_cap(t, invalid):
                t.hit_invalid_call_limit, t.done = True, True
                return
            turn = self.renderer.tool_turn(answers, t.last_turn[-1])
            t.messages += [{"role": "tool", "content": a} for a in answers]
        elif not calls and t.interaction is not None:
            answer = await self._interaction_reply(t)
            if answer is None:  # the interaction failed (counted): the trajectory ends on the model's turn
                t.done = True
                return
            stop, reply = answer
            if stop or at_limit:
                t.hit_turn_limit, t.done = at_limit and not stop, True
                return
            turn = self.renderer.user_turn(reply, t.last_turn[-1])
            t.messages.append({"role": "user", "content": reply})
        else:  # a final answer, or calls past the turn limit
            t.hit_turn_limit, t.done = bool(calls), True
            return
        if len(t.tokens) + len(turn) >= response_length:  # no room for another assistant turn
            t.hit_length_limit, t.done = True, True
            return
        t.tokens += turn
        t.mask += [0] * len(turn)
        t.log_probs += [0.0] * len(turn)
        t.user_turns += 1

    def _is_void(self, text: str) -> bool:
        """A turn without calls that gives no final answer (blank, or not matching final_answer_pattern)."""
        return not text.strip() or (self.final_answer is not None and not self.final_answer.search(text))

    def _past_invalid_call_cap(self, t: _Trajectory, invalid: Sequence[bool]) -> bool:
        """Update the run of invalid calls in the order the model made them; True at the cap."""
        for bad in invalid:
            t.consecutive_invalid = t.consecutive_invalid + 1 if bad else 0
        cap = self.config.max_consecutive_invalid_tool_calls
        return cap is not None and t.consecutive_invalid >= cap

    def _at_turn_limit(self, t: _Trajectory) -> bool:
        cfg = self.config
        return bool((cfg.max_assistant_turns and t.assistant_turns >= cfg.max_assistant_turns)
                    or (cfg.max_user_turns and t.user_turns >= cfg.max_user_turns))

    # ------------------------------------------------------------------ tools
    async def _call(self, t: _Trajectory, call: ToolCall | ToolCallError,
                    limit: asyncio.Semaphore) -> tuple[str, bool]:
        """The answer the model reads for one call (an ``Error: ...`` text when it failed), and whether
        the call was invalid (the model's fault: the invalid-call guard counts it)."""
        t.tool_calls += 1
        if isinstance(call, ToolCallError):
            t.tool_errors += 1
            t.invalid_calls += 1
            return f"Error: {call.message}", True
        timeout = float(self.config.tool_timeout_s)
        async with limit:
            try:
                text, metrics = await self._execute(t, call, timeout)
            except UserCodeTimeout:
                _log_abandoned(f"tool {call.name}", timeout, "tool_timeout_s")
                text, metrics = f"Error: {call.name} did not answer within {timeout:g} s", _TIMED_OUT
            except Exception as err:  # a tool's bug is the model's error message, and a logged count
                logger.warning("tool %s raised %s: %s", call.name, type(err).__name__, err)
                text, metrics = f"Error: {call.name} failed: {type(err).__name__}: {err}", _FAILED
        invalid = _count_tool_metrics(t, metrics)
        answer = truncate_text(_valid_text(text), int(self.config.max_tool_response_length),
                               self.config.tool_response_truncate_side)
        return answer, invalid

    async def _execute(self, t: _Trajectory, call: ToolCall, timeout: float) -> tuple[str, dict]:
        """The tool's answer text and metrics; its create() (first call) and execute() each get ``timeout``."""
        tool = self.tools[call.name]
        async with t.create_lock:
            if call.name not in t.instances:
                create = functools.partial(tool.create, None, **_tool_kwargs(t, call.name, "create_kwargs"))
                created = await run_user_code(create, timeout=timeout, what=f"tool {call.name}.create")
                t.instances[call.name] = created[0] if isinstance(created, tuple) else created
        execute = functools.partial(tool.execute, t.instances[call.name], call.arguments,
                                    **_tool_kwargs(t, call.name, "execute_kwargs"))
        response, step_reward, metrics = await run_user_code(execute, timeout=timeout, what=f"tool {call.name}.execute")
        t.tool_reward += _finite(step_reward or 0.0, "step reward")
        return str(ToolResponse.of(response).text or ""), dict(metrics or {})

    async def _finish(self, t: _Trajectory) -> None:
        """Tool rewards (calc_reward), the interaction's score; instances released. A failing method
        is counted and logged; the others still run."""
        for name, instance in t.instances.items():
            tool = self.tools[name]
            reward = await self._tool_finish_call(t, name, "calc_reward", tool.calc_reward, instance,
                                                  **_tool_kwargs(t, name, "calc_reward_kwargs"))
            if reward is not None:
                t.tool_reward += reward
            await self._tool_finish_call(t, name, "release", tool.release, instance,
                                         **_tool_kwargs(t, name, "release_kwargs"))
        if t.interaction is not None and t.interaction_id is not None:
            ok, score = await self._interaction_call(t, "calculate_score", t.interaction_id)
            try:
                t.interaction_score = _finite(score, "score") if ok else 0.0
            except ValueError as err:
                logger.warning("interaction %s.calculate_score: %s", getattr(t.interaction, "name", "?"), err)
                t.interaction_errors += 1
            await self._interaction_call(t, "finalize_interaction", t.interaction_id)

    async def _tool_finish_call(self, t: _Trajectory, name: str, method: str, fn: Any, *args: Any,
                                **kwargs: Any) -> float | None:
        """``calc_reward`` (its finite reward) or ``release`` (0.0); None when it failed (counted, logged)."""
        timeout = float(self.config.tool_timeout_s)
        what = f"tool {name}.{method}"
        try:
            async with self._lifecycle:
                out = await run_user_code(functools.partial(fn, *args, **kwargs), timeout=timeout, what=what)
            return _finite(out, "reward") if method == "calc_reward" else 0.0
        except UserCodeTimeout:
            _log_abandoned(what, timeout, "tool_timeout_s")
        except Exception as err:
            logger.warning("%s raised %s: %s", what, type(err).__name__, err)
        t.tool_finish_errors += 1
        return None

    # ------------------------------------------------------------------ output
    def _assemble(self, rows: Batch, trajs: list[_Trajectory], sampling: SamplingParams) -> Batch:
        n, r = len(trajs), sampling.response_length
        dev = rows["input_ids"].device
        responses = torch.full((n, r), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros(n, r, dtype=torch.long)
        filled = torch.zeros(n, r, dtype=torch.long)
        log_probs = torch.zeros(n, r, dtype=torch.float32)
        for i, t in enumerate(trajs):
            length = len(t.tokens)
            responses[i, :length] = torch.tensor(t.tokens, dtype=torch.long)
            response_mask[i, :length] = torch.tensor(t.mask, dtype=torch.long)
            filled[i, :length] = 1
            log_probs[i, :length] = torch.tensor(t.log_probs, dtype=torch.float32)
        prompt_mask = rows["attention_mask"]
        prompt_pos = rows["position_ids"] if "position_ids" in rows else (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        resp_pos = prompt_pos[:, -1:] + torch.arange(1, r + 1, device=dev)
        if self.config.filter_void_turns:  # zero loss weight, as the trainer's padding rows
            response_mask[[i for i, t in enumerate(trajs) if t.void_turns]] = 0
        tensors = {
            "prompts": rows["input_ids"], "responses": responses.to(dev), "response_mask": response_mask.to(dev),
            "input_ids": torch.cat([rows["input_ids"], responses.to(dev)], dim=1),
            "attention_mask": torch.cat([prompt_mask, filled.to(dev, prompt_mask.dtype)], dim=1),
            "position_ids": torch.cat([prompt_pos, resp_pos], dim=1),
        }
        if sampling.calculate_log_probs:
            tensors["rollout_log_probs"] = log_probs.to(dev) * response_mask.to(dev)
        non_tensors = dict(rows.non_tensor_batch)
        non_tensors.update(_columns(trajs, bool(self.config.filter_void_turns), offers_tools=bool(self.tools)))
        return Batch.from_dict(tensors, non_tensors, dict(rows.meta_info))


_TIMED_OUT = {"tool_error": 1.0, "tool_timeout": 1.0}
_FAILED = {"tool_error": 1.0}


def _tool_kwargs(t: _Trajectory, tool: str, key: str) -> dict:
    """The row's ``tools_kwargs[tool][key]`` keywords; {} when absent (start-up checks name a malformed one)."""
    entry = t.tools_kwargs.get(tool)
    value = entry.get(key) if isinstance(entry, dict) else None
    return {str(k): v for k, v in value.items()} if isinstance(value, dict) else {}


def _finite(value: Any, what: str) -> float:
    """``value`` as a finite float; ValueError naming ``what`` otherwise (a NaN reward would poison the batch)."""
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"the {what} {number} is not a finite number")
    return number


def _valid_text(text: str) -> str:
    """``text`` with what no tokenizer can encode (unpaired surrogates, e.g. from a JSON ``\\ud800``) replaced."""
    return str(text).encode("utf-8", "replace").decode("utf-8")


def _log_abandoned(what: str, timeout: float, key: str) -> None:
    logger.warning("%s did not return within %g s (multi_turn.%s); the call is abandoned in its daemon thread "
                   "(%d abandoned in this process so far; they end with it)", what, timeout, key, abandoned_calls())


def _count_tool_metrics(t: _Trajectory, metrics: dict) -> bool:
    """Count a run call's errors, time-outs and sandbox kills; True when the tool calls it invalid."""
    t.tool_errors += int(bool(metrics.get("tool_error")))
    t.tool_timeouts += int(bool(metrics.get("tool_timeout")))
    kill = metrics.get("sandbox_kill")
    if kill:
        t.sandbox_kills[kill if kill in t.sandbox_kills else "killed"] += 1
    invalid = bool(metrics.get("invalid_tool_call"))
    t.invalid_calls += int(invalid)
    return invalid


def _columns(trajs: list[_Trajectory], filter_void: bool, offers_tools: bool) -> dict[str, np.ndarray]:
    """The per-row ``multi_turn/*`` columns (their means are the step's metrics); with tools offered,
    ``tool_call_rate``: 1 where the trajectory called a tool, so its mean is the share of responses that did."""
    values = {
        "multi_turn/turns": [t.assistant_turns + t.user_turns for t in trajs],
        "multi_turn/assistant_turns": [t.assistant_turns for t in trajs],
        "multi_turn/tool_calls": [t.tool_calls for t in trajs],
        "multi_turn/tool_errors": [t.tool_errors for t in trajs],
        "multi_turn/valid_tool_calls": [t.tool_calls - t.invalid_calls for t in trajs],
        "multi_turn/invalid_tool_calls": [t.invalid_calls for t in trajs],
        "multi_turn/tool_timeouts": [t.tool_timeouts for t in trajs],
        **{f"multi_turn/sandbox_kills/{c}": [t.sandbox_kills[c] for t in trajs] for c in KILL_CAUSES},
        "multi_turn/hit_turn_limit": [t.hit_turn_limit for t in trajs],
        "multi_turn/hit_length_limit": [t.hit_length_limit for t in trajs],
        "multi_turn/hit_invalid_call_limit": [t.hit_invalid_call_limit for t in trajs],
        "multi_turn/void_turns": [t.void_turns for t in trajs],
        "multi_turn/void_filtered": [filter_void and t.void_turns > 0 for t in trajs],
        "multi_turn/tool_finish_errors": [t.tool_finish_errors for t in trajs],
        "multi_turn/interaction_errors": [t.interaction_errors for t in trajs],
        "multi_turn/interaction_timeouts": [t.interaction_timeouts for t in trajs],
        "multi_turn/tool_reward": [t.tool_reward for t in trajs],
        "multi_turn/interaction_score": [t.interaction_score for t in trajs],
    }
    if offers_tools:
        values[TOOL_CALL_RATE] = [t.tool_calls > 0 for t in trajs]
    return {k: np.asarray(v, dtype=np.float64) for k, v in values.items()}


def multi_turn_columns(batch: Batch) -> dict[str, np.ndarray]:
    """The per-row ``multi_turn/*`` columns of a rollout batch (empty for a single-turn one)."""
    return {k: np.asarray(v, dtype=np.float64) for k, v in batch.non_tensor_batch.items() if k.startswith("multi_turn/")}


def multi_turn_rewards(batch: Batch) -> torch.Tensor | None:
    """Per-row tool rewards plus interaction score ``[N]``, or None for a single-turn batch."""
    cols = batch.non_tensor_batch
    if REWARD_COLUMNS[0] not in cols:
        return None
    return torch.as_tensor(np.asarray(cols[REWARD_COLUMNS[0]], dtype=np.float64)
                           + np.asarray(cols[REWARD_COLUMNS[1]], dtype=np.float64), dtype=torch.float32)


def _row_field(rows: Batch, key: str, i: int) -> Any:
    col = rows.non_tensor_batch.get(key)
    return None if col is None else col[i]


def _left_padded(contexts: list[list[int]], pad: int) -> Batch:
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(contexts), width, dtype=torch.long)
    for i, c in enumerate(contexts):
        ids[i, width - len(c):] = torch.tensor(c, dtype=torch.long)
        mask[i, width - len(c):] = 1
    return Batch.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)})
