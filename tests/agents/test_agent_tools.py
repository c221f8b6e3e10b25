"""Tool calling through the endpoint: the model's hermes ``<tool_call>`` text as OpenAI ``tool_calls``,
results sent back as ``role: tool`` messages, and the trajectory equal, token for token, to the one
posttrain's own multi-turn loop builds for the same model and tool (an independent reference)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from helpers.tokenizer import build_tiny_tokenizer  # noqa: E402

from posttrain.agents.rollout import AgentRollout, agent_step_metrics  # noqa: E402
from posttrain.batch import Batch  # noqa: E402
from posttrain.config.actor_rollout_ref import AgentEpisodeConfig, MultiTurnConfig  # noqa: E402
from posttrain.rollout.base import SamplingParams  # noqa: E402
from posttrain.rollout.multi_turn import MultiTurnRollout  # noqa: E402
from posttrain.serve import chat_tools  # noqa: E402
from posttrain.serve.server import CompletionServer  # noqa: E402
from posttrain.tools import build_tools  # noqa: E402
from posttrain.tools.calculator_tool import CalculatorTool  # noqa: E402

from test_agent_rollout import HARNESSES, prompt_batch, rows_of, seen_by  # noqa: E402

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


class ScriptedEngine:
    """Each context's next turn by its question and the tool results it holds so far (``scripts[question]``)."""

    def __init__(self, tok, scripts):
        self.tok, self.scripts, self.pad_token_id = tok, scripts, tok.pad_token_id

    def generate(self, batch, sampling):
        rows = []
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            text = self.tok.decode(ids[mask.bool()].tolist())
            turns = next(v for k, v in self.scripts.items() if k in text)
            turn = turns[min(text.count("<tool_response>"), len(turns) - 1)]
            rows.append(self.tok.encode(turn, add_special_tokens=False) + [self.tok.eos_token_id])
        r = sampling.response_length
        resp = torch.full((len(rows), r), self.pad_token_id)
        mask = torch.zeros(len(rows), r, dtype=torch.long)
        for i, row in enumerate(rows):
            row = row[:r]
            resp[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
        lps = -0.25 * torch.arange(1, r + 1).float().expand(len(rows), r) * mask
        return Batch.from_dict({"responses": resp, "response_mask": mask, "rollout_log_probs": lps})


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_split_tool_calls_valid_invalid_and_text(tok):
    bad = '<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>'
    content, calls, invalid = chat_tools.split_tool_calls(f"Let me see. {CALL}", [CALCULATOR])
    assert (content, [(c.name, c.arguments) for c in calls], invalid) == ("Let me see.", [("calculator", {"expression": "2*3"})], 0)
    content, calls, invalid = chat_tools.split_tool_calls(f"{bad} then {CALL}", [CALCULATOR])
    assert content == f"{bad} then" and len(calls) == 1 and invalid == 1  # a call outside the schema stays text
    assert chat_tools.split_tool_calls(CALL, None) == (CALL, [], 0)  # no tools offered: plain text
    message, _ = chat_tools.reply_message(CALL, [CALCULATOR], "abc", 0)
    assert message == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc_0_0", "type": "function",
         "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}]}


def test_history_renders_as_the_multi_turn_loop_renders_it(tok):
    """A template without tool_calls/tool role (the tiny one, SmolLM2's): calls written back as
    <tool_call> text, a run of tool results as one user turn of <tool_response> blocks."""
    form = chat_tools.TemplateForm.of(tok)
    assert form == chat_tools.TemplateForm(tools=False, tool_calls=False, tool_role=False)
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}}]},
                {"role": "tool", "content": "6"}, {"role": "tool", "content": "7"}]
    assert chat_tools.template_messages(messages, form) == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": CALL},
        {"role": "user", "content": "<tool_response>\n6\n</tool_response>\n<tool_response>\n7\n</tool_response>"}]
    after = chat_tools.render_after(tok, messages[2:], None, tok.eos_token_id)
    assert tok.decode(after) == ("\n<|im_start|>user\n<tool_response>\n6\n</tool_response>\n<tool_response>\n7\n"
                                 "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_tool_calls_through_the_openai_client(tok):
    engine = ScriptedEngine(tok, {"q1": [CALL, "2*3 = 6\n#### 6"]})
    with CompletionServer(engine, tok, model_name="m", default_max_tokens=200) as server:
        client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "q1"}]
        r = client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
            "function", "calculator", {"expression": "2*3"})
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "6"}]
        r2 = client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR], logprobs=True)
        assert r2.choices[0].message.content == "2*3 = 6\n#### 6" and r2.choices[0].finish_reason == "stop"
        assert not r2.choices[0].message.tool_calls
        # without tools the same text is content
        plain = client.chat.completions.create(model="m", messages=messages[:1])
        assert plain.choices[0].message.content == CALL and plain.choices[0].finish_reason == "stop"
        # streaming carries the calls in the delta
        chunks = list(client.chat.completions.create(model="m", messages=messages[:1], tools=[CALCULATOR], stream=True))
        calls = [c for ch in chunks if ch.choices for c in (ch.choices[0].delta.tool_calls or [])]
        assert [c.function.name for c in calls] == ["calculator"]
        # tool_choice other than auto/none is one error
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            client.chat.completions.create(model="m", messages=messages[:1], tools=[CALCULATOR], tool_choice="required")


def test_agent_trajectory_equals_the_multi_turn_loops(tok):
    """The same model and tool through the endpoint (a plain openai tool-calling loop) and through
    posttrain's multi-turn loop: the same tokens, mask and log-probs, row for row."""
    scripts = {"q1": [CALL, "2*3 = 6\n#### 6"], "q2": ["#### 6"], "q3": [CALL, CALL, "#### 6"]}
    questions = list(scripts)
    engine = ScriptedEngine(tok, scripts)
    sampling = SamplingParams(n=1, response_length=400)
    native = MultiTurnRollout(engine, tok, MultiTurnConfig(enable=True, max_assistant_turns=3),
                              build_tools([CalculatorTool()])).generate(prompt_batch(tok, questions), sampling)
    config = SimpleNamespace(agent=SimpleNamespace(episode=AgentEpisodeConfig(path=HARNESSES, name="calculator_agent")))
    rollout = AgentRollout(engine, tok, config)
    try:
        out = rollout.generate(prompt_batch(tok, questions), sampling)
        metrics = agent_step_metrics(out)
    finally:
        rollout.close()
    assert metrics["agent/retokenized_tokens"] == 0 and metrics["agent/sequences"] == 3
    assert metrics["agent/tool_calls"] == 3 and metrics["agent/invalid_tool_calls"] == 0
    assert metrics["agent/calls"] == 6 and metrics["agent/reused_prompts"] == 3
    assert [o.reward for o in rollout.last_outcomes] == [1.0, 1.0, 1.0]
    for key in ("prompts", "responses", "response_mask", "attention_mask", "position_ids"):
        assert torch.equal(out[key], native[key]), key
    assert torch.allclose(out["rollout_log_probs"], native["rollout_log_probs"])
    # the tool turn is in the response, unmasked (the multi-turn loop's layout)
    r = rows_of(out, 0)[0]
    text = tok.decode(out["responses"][r][out["attention_mask"][r, out["prompts"].shape[1]:].bool()].tolist())
    assert "<tool_response>\n6\n</tool_response>" in text
    seen = seen_by(rollout, rollout.last_episodes[0])
    assert seen[0]["finish_reason"] == "tool_calls" and seen[1]["finish_reason"] == "stop"
