"""Faults of user code and of the model's own output in the multi-turn loop (issue 40): a tool or an
interaction that blocks its event loop or never returns is timed out and counted; user code that raises
(calc_reward, start_interaction, generate_response, ...) is a counted outcome of its trajectory; any
text the model writes after <tool_call> ends as a tool message, never an exception."""

import asyncio
import json
import threading

import numpy as np
import pytest

from helpers.tiny_models import tiny_prompt_batch
from posttrain.config.actor_rollout_ref import MultiTurnConfig
from posttrain.interactions.base import BaseInteraction
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.multi_turn import MultiTurnRollout
from posttrain.rollout.tool_parser import MAX_NESTING, ToolCall, ToolCallError, parse_tool_calls
from posttrain.tools import build_tools
from posttrain.tools.base_tool import BaseTool
from posttrain.tools.calculator_tool import CalculatorTool
from test_multi_turn import CALL, ScriptedEngine, _rollout, _texts

SCHEMA = {"type": "function", "function": {"name": "block", "description": "x",
                                           "parameters": {"type": "object", "properties": {}}}}
BLOCK = '<tool_call>{"name": "block", "arguments": {}}</tool_call>'


@pytest.fixture(scope="module")
def tok():
    from helpers.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture
def release():
    """An event the blocking user code below waits on (at most 60 s); set when the test ends, so no
    thread outlives it. Without the fix the loop would wait the 60 s and then read the tool's answer."""
    event = threading.Event()
    yield event
    event.set()


def _blocking_tool(release: threading.Event, log: list) -> BaseTool:
    class Blocking(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            release.wait(60)  # blocks this coroutine's event loop, as time.sleep would
            log.append("returned")
            return "finished", 0.0, {}

    return Blocking({}, SCHEMA)


# ---------------------------------------------------------------- user code that blocks or never returns
def test_a_tool_that_blocks_its_event_loop_is_timed_out_and_the_other_rows_go_on(tok, release):
    log = []
    out, _ = _rollout(tok, {"A:": [BLOCK, "a"], "B:": [CALL, "b"]}, [_blocking_tool(release, log), CalculatorTool()],
                      tool_timeout_s=0.3, max_parallel_calls=2)
    texts, cols = _texts(tok, out), out.non_tensor_batch
    assert "Error: block did not answer within 0.3 s" in texts[0] and texts[0].endswith("a<|im_end|>")
    assert "finished" not in texts[0] and log == []  # answered by the time-out, not by the tool
    assert "<tool_response>\n5535\n</tool_response>" in texts[1]  # row B's call ran meanwhile
    assert cols["multi_turn/tool_timeouts"].tolist() == [1, 0] and cols["multi_turn/tool_errors"].tolist() == [1, 0]


def test_a_blocked_call_is_abandoned_in_a_daemon_thread():
    from posttrain.tools.user_code import UserCodeTimeout, run_user_code

    stop = threading.Event()

    async def main():
        with pytest.raises(UserCodeTimeout, match="stuck did not answer within 0.1 s"):
            await run_user_code(lambda: stop.wait(60), timeout=0.1, what="stuck")

    try:
        asyncio.run(main())
        stuck = [t for t in threading.enumerate() if t.name == "posttrain stuck"]
        assert len(stuck) == 1 and stuck[0].daemon  # still blocked, and it cannot keep the process alive
    finally:
        stop.set()


class _Interaction(BaseInteraction):
    """Answers "try again" once, then ends; ``fail`` names a method that raises instead, ``block`` one
    that blocks its event loop (until the test ends)."""

    def __init__(self, fail: str = "", block: str = "", release: threading.Event | None = None):
        super().__init__({"name": "judge"})
        self.fail, self.block, self.release, self.replies = fail, block, release, 0

    def _fault(self, method: str) -> None:
        if method == self.fail:
            raise RuntimeError(f"{method} is broken")
        if method == self.block:
            self.release.wait(60)

    async def start_interaction(self, instance_id=None, **kwargs):
        self._fault("start_interaction")
        return "iid"

    async def generate_response(self, instance_id, messages, **kwargs):
        self._fault("generate_response")
        self.replies += 1
        return (self.replies > 1), "try again", 0.0, {}

    async def calculate_score(self, instance_id, **kwargs):
        self._fault("calculate_score")
        return 0.5

    async def finalize_interaction(self, instance_id, **kwargs):
        self._fault("finalize_interaction")


def _with_interaction(tok, interaction, **mt):
    engine = ScriptedEngine(tok, {"A:": ["#### 1", "#### 2", "#### 3"]})
    loop = MultiTurnRollout(engine, tok, MultiTurnConfig(enable=True, max_user_turns=3, **mt), [],
                            {"judge": interaction})
    prompts = tiny_prompt_batch(tok, ["A:"])
    prompts.non_tensor_batch["extra_info"] = np.array([{"interaction_kwargs": {"name": "judge"}}], dtype=object)
    out = loop.generate(prompts, SamplingParams(n=1, response_length=300))
    cols = out.non_tensor_batch
    return (cols["multi_turn/assistant_turns"][0], cols["multi_turn/interaction_score"][0],
            cols["multi_turn/interaction_errors"][0], cols["multi_turn/interaction_timeouts"][0])


def test_an_interaction_that_never_answers_is_timed_out(tok, release):
    # negative control: the same interaction without the fault talks for two turns, scores 0.5, no errors
    assert _with_interaction(tok, _Interaction()) == (2, 0.5, 0, 0)
    turns, score, errors, timeouts = _with_interaction(tok, _Interaction(block="generate_response", release=release),
                                                       interaction_timeout_s=0.3)
    assert (turns, errors, timeouts) == (1, 1, 1)  # ended on the model's first turn
    assert score == 0.5  # calculate_score still ran


@pytest.mark.parametrize("method, expected", [
    ("start_interaction", (1, 0.0, 1, 0)),  # no interaction for this row: one turn, no score
    ("generate_response", (1, 0.5, 1, 0)),  # ends on the model's turn; the score is still read
    ("calculate_score", (2, 0.0, 1, 0)),
    ("finalize_interaction", (2, 0.5, 1, 0)),
])
def test_an_interaction_that_raises_is_a_counted_outcome(tok, method, expected, caplog):
    assert _with_interaction(tok, _Interaction(fail=method)) == expected
    assert f"interaction judge.{method} raised RuntimeError: {method} is broken" in caplog.text


def test_tool_calc_reward_and_release_that_raise_or_block_are_counted(tok, release):
    class Rewarding(BaseTool):
        def __init__(self, name, fault):
            super().__init__({}, {**SCHEMA, "function": {**SCHEMA["function"], "name": name}})
            self.fault = fault

        async def execute(self, instance_id, parameters, **kwargs):
            return "ok", 0.25, {}

        async def calc_reward(self, instance_id, **kwargs):
            if self.fault == "raise":
                raise KeyError("no such instance")
            if self.fault == "block":
                release.wait(60)
            return float("nan") if self.fault == "nan" else 1.0

        async def release(self, instance_id, **kwargs):
            if self.fault == "raise":
                raise SystemExit(3)  # not the end of the run: a failure of this call

    tools = [Rewarding("good", ""), Rewarding("bad", "raise"), Rewarding("slow", "block"), Rewarding("nan", "nan")]
    calls = "".join(f'<tool_call>{{"name": "{t.name}", "arguments": {{}}}}</tool_call>' for t in tools)
    out, _ = _rollout(tok, {"A:": [calls, "done"], "B:": ['<tool_call>{"name": "good", "arguments": {}}</tool_call>',
                                                          "done"]}, tools, tool_timeout_s=0.3, max_parallel_calls=4)
    cols = out.non_tensor_batch
    # A: four step rewards of 0.25 and only the good tool's calc_reward (1.0); bad raises in calc_reward and
    # in release, slow times out, nan returns a non-finite reward: four failures. B: untouched.
    assert cols["multi_turn/tool_reward"].tolist() == [2.0, 1.25]
    assert cols["multi_turn/tool_finish_errors"].tolist() == [4, 0]
    assert cols["multi_turn/tool_errors"].tolist() == [0, 0]


# ---------------------------------------------------------------- the model's own output
@pytest.mark.parametrize("body", [
    "[" * 20000,
    '{"name": "calculator", "arguments": ' + '{"a": ' * 5000 + "1" + "}" * 5001,
    '{"name": "calculator", "arguments": "' + "[" * 20000 + '"}',  # nested inside the arguments string
])
def test_deeply_nested_calls_are_invalid_calls_not_exceptions(body):
    schemas = {"calculator": CalculatorTool().tool_schema}
    decoded = body if not body.endswith('"}') else json.loads(body)["arguments"]
    with pytest.raises(RecursionError):  # the trigger is real: Python's decoder recurses on it
        json.loads(decoded)
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>", schemas)
    assert isinstance(call, ToolCallError) and f"more than {MAX_NESTING} deep" in call.message


def test_nesting_within_the_bound_and_brackets_in_strings_still_parse():
    schema = {"type": "function", "function": {"name": "echo", "description": "x", "parameters": {
        "type": "object", "properties": {"v": {}}, "required": ["v"]}}}
    schemas = {"echo": BaseTool({}, schema).tool_schema}
    deep = "[" * (MAX_NESTING - 2) + "]" * (MAX_NESTING - 2)
    text = f'<tool_call>{{"name": "echo", "arguments": {{"v": {deep}}}}}</tool_call>'
    assert parse_tool_calls(text, schemas) == [ToolCall("echo", {"v": json.loads(deep)})]
    brackets = "[{" * 500  # inside a string they do not nest
    text = f'<tool_call>{{"name": "echo", "arguments": {{"v": "{brackets}"}}}}</tool_call>'
    assert parse_tool_calls(text, schemas) == [ToolCall("echo", {"v": brackets})]


@pytest.mark.parametrize("body, message", [
    ('{"name": "calculator", "arguments": {"expression": ' + "9" * 5000 + "}}", "cannot be decoded (ValueError"),
    ('{"name": "calculator", "arguments": "{\\"expression\\": ' + "9" * 5000 + '}"}', "cannot be decoded"),
    ('{"name": "calculator", "arguments": {"expression": "' + "1" * 200_000 + '"}}', "characters long"),
])
def test_other_decoder_failures_are_invalid_calls(body, message):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>", {"calculator": CalculatorTool().tool_schema})
    assert isinstance(call, ToolCallError) and message in call.message


def test_a_turn_of_brackets_ends_as_a_tool_message_the_model_reads(tok):
    out, _ = _rollout(tok, {"A:": ["<tool_call>" + "[" * 3000 + "</tool_call>", "ok"]}, [CalculatorTool()],
                      response_length=4000)
    text, cols = _texts(tok, out)[0], out.non_tensor_batch
    assert "Error: the tool call nests arrays/objects more than 64 deep" in text and text.endswith("ok<|im_end|>")
    assert cols["multi_turn/invalid_tool_calls"].tolist() == [1]


def test_an_unpaired_surrogate_in_the_arguments_reaches_the_model_as_text(tok):
    def echo(text: str) -> str:
        """Echo.

        Args:
            text: what to echo.
        """
        return "got " + text

    call = '<tool_call>{"name": "echo", "arguments": {"text": "\\ud800!"}}</tool_call>'
    engine = ScriptedEngine(tok, {"A:": [call, "ok"]})
    loop = MultiTurnRollout(engine, tok, MultiTurnConfig(enable=True), build_tools([echo]))
    out = loop.generate(tiny_prompt_batch(tok, ["A:"]), SamplingParams(n=1, response_length=400))
    text = _texts(tok, out)[0]
    assert "got ?!" in text and text.endswith("ok<|im_end|>")


def test_time_out_keys_are_checked_at_start_up():
    from posttrain.errors import ConfigError
    from posttrain.rollout.multi_turn_checks import check_guards

    check_guards(MultiTurnConfig(enable=True, tool_timeout_s=0.5, interaction_timeout_s=2))
    for key, value in (("tool_timeout_s", 0.0), ("interaction_timeout_s", float("nan")),
                       ("interaction_timeout_s", float("inf")), ("tool_timeout_s", -1)):
        with pytest.raises(ConfigError, match=f"multi_turn.{key}=.*expected a positive, finite number"):
            check_guards(MultiTurnConfig(enable=True, **{key: value}))
