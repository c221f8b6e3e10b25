"""The multi-turn agent loop: a trajectory's tokens, mask and log-probs checked token by token
against a hand-built case (the real hf engine, its sampler patched to emit scripted tokens, as
TRL's tests do), concurrency and time-outs of tool calls, failing tools, turn and length limits."""

import asyncio
import time

import numpy as np
import pytest
import torch

from helpers.tiny_models import tiny_llama, tiny_prompt_batch, tiny_worker_configs
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.batch import Batch
from posttrain.config.actor_rollout_ref import MultiTurnConfig
from posttrain.rollout import hf as hf_module
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.multi_turn import MultiTurnRollout, truncate_text
from posttrain.rollout.tool_parser import ToolCall, ToolCallError, parse_tool_calls
from posttrain.tools import build_tools
from posttrain.tools.base_tool import BaseTool
from posttrain.tools.calculator_tool import CalculatorTool

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


# ---------------------------------------------------------------- parser
def test_parser_valid_invalid_unknown_wrong_and_none():
    schemas = {"calculator": CalculatorTool().tool_schema}
    text = ("I will compute. " + CALL + ' <tool_call>{"name": "calculator", "arguments": {bad}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": 5}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>')
    calls = parse_tool_calls(text, schemas)
    assert calls[0] == ToolCall("calculator", {"expression": "123*45"})
    assert isinstance(calls[1], ToolCallError) and "not valid JSON" in calls[1].message
    assert calls[2] == ToolCallError("unknown tool 'search'; available: calculator", "search")
    assert isinstance(calls[3], ToolCallError) and "must be string, got int" in calls[3].message
    assert calls[4] == ToolCall("calculator", {"expression": "1+1"})  # arguments sent as a JSON string
    assert parse_tool_calls("The answer is 5535.", schemas) == []
    assert "no closing" in parse_tool_calls("<tool_call>{\"name\": ", schemas)[0].message


def test_truncation_sides():
    assert truncate_text("abcdefghij", 20, "middle") == "abcdefghij"
    assert truncate_text("abcdefghij", 4, "left") == "abcd...(truncated)"
    assert truncate_text("abcdefghij", 4, "right") == "(truncated)...ghij"
    assert truncate_text("abcdefghij", 4, "middle") == "ab...(truncated)...ij"


# ---------------------------------------------------------------- a hand-built trajectory, real engine
def _scripted_sampler(monkeypatch, tok, turns: list[str]):
    """Patch the hf engine's sampler: it emits ``turns`` (each ending with EOS) one token per step,
    reporting the true log-softmax of the model's logits at that token (one row at a time)."""
    queue = [t for turn in turns for t in tok.encode(turn, add_special_tokens=False) + [tok.eos_token_id]]

    def sample(logits, sampling, want_log_probs):
        token = torch.tensor([queue.pop(0)] * logits.shape[0])
        lp = torch.log_softmax(logits.float(), -1).gather(-1, token[:, None]).squeeze(-1)
        return token, (lp if want_log_probs else None)

    monkeypatch.setattr(hf_module, "_sample", sample)
    return queue


def test_trajectory_tokens_mask_and_log_probs_token_by_token(tok, monkeypatch):
    from posttrain.workers.actor import ActorWorker

    cfg = tiny_worker_configs(response_length=220)
    actor = ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=tiny_llama(tok, seed=3), tokenizer=tok)
    loop = MultiTurnRollout(actor.rollout, tok, MultiTurnConfig(enable=True, max_assistant_turns=4), [CalculatorTool()])
    queue = _scripted_sampler(monkeypatch, tok, ["Let me " + CALL, "It is 5535."])
    prompts = tiny_prompt_batch(tok, ["<|im_start|>user\n123*45?<|im_end|>\n<|im_start|>assistant\n"])
    out = loop.generate(prompts, SamplingParams(n=1, temperature=1.0, response_length=220))
    assert queue == []

    eos = [tok.eos_token_id]
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    turn1, turn2 = enc("Let me " + CALL) + eos, enc("It is 5535.") + eos
    tool_turn = enc("\n<|im_start|>user\n<tool_response>\n5535\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    expected = turn1 + tool_turn + turn2
    length = len(expected)
    assert out["responses"][0, :length].tolist() == expected
    assert out["response_mask"][0].tolist() == [1] * len(turn1) + [0] * len(tool_turn) + [1] * len(turn2) + [0] * (220 - length)
    assert out["attention_mask"][0, -220:].tolist() == [1] * length + [0] * (220 - length)
    assert (out["responses"][0, length:] == tok.pad_token_id).all()
    cols = out.non_tensor_batch
    assert (cols["multi_turn/assistant_turns"][0], cols["multi_turn/tool_calls"][0], cols["multi_turn/turns"][0]) == (2, 1, 3)
    assert cols["multi_turn/tool_errors"][0] == 0 and cols["multi_turn/hit_turn_limit"][0] == 0

    # the actor recomputes the rollout's log-probs on model tokens over the whole concatenated trajectory
    out.meta_info["temperature"] = 1.0
    recomputed, _ = actor.compute_log_prob(out)
    mask = out["response_mask"].bool()
    assert torch.allclose(recomputed[mask], out["rollout_log_probs"][mask], atol=1e-5)
    assert (out["rollout_log_probs"][~mask] == 0).all() and (out["rollout_log_probs"][mask] < 0).all()
    # negative control: a trajectory whose tool tokens are not attended (attention_mask = response_mask
    # on the response, a plausible bug) gives other log-probs on the second turn
    blind = Batch.from_dict({**{k: out[k] for k in out.batch.keys()},
                             "attention_mask": torch.cat([out["attention_mask"][:, :-220], out["response_mask"]], 1)})
    blind.meta_info["temperature"] = 1.0
    second = torch.zeros_like(mask)
    second[0, len(turn1) + len(tool_turn):length] = True
    assert not torch.allclose(actor.compute_log_prob(blind)[0][second], out["rollout_log_probs"][second], atol=1e-3)


# ---------------------------------------------------------------- a scripted engine: rows at different turns
class ScriptedEngine:
    """``generate`` returns, for each context row, the next turn of the script chosen by the row's
    prompt text: ``scripts[prompt] = [turn text, ...]`` (a turn repeats its last entry when exhausted)."""

    def __init__(self, tok, scripts):
        self.tok, self.scripts, self.pad_token_id = tok, scripts, tok.pad_token_id
        self.calls = []

    def generate(self, batch, sampling):
        rows = []
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            text = self.tok.decode(ids[mask.bool()].tolist())
            prompt = next(p for p in self.scripts if text.startswith(p))
            turn = min(text.count("<tool_response>") + text.count("try again"), len(self.scripts[prompt]) - 1)
            rows.append(self.tok.encode(self.scripts[prompt][turn], add_special_tokens=False) + [self.tok.eos_token_id])
        self.calls.append(len(rows))
        r = sampling.response_length
        resp = torch.full((len(rows), r), self.pad_token_id)
        mask = torch.zeros(len(rows), r, dtype=torch.long)
        for i, row in enumerate(rows):
            row = row[:r]
            resp[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
        return Batch.from_dict({"responses": resp, "response_mask": mask, "rollout_log_probs": -0.5 * mask.float()})


def _rollout(tok, scripts, tools, response_length=1200, **mt):
    engine = ScriptedEngine(tok, scripts)
    loop = MultiTurnRollout(engine, tok, MultiTurnConfig(enable=True, **mt), build_tools(tools))
    out = loop.generate(tiny_prompt_batch(tok, list(scripts)), SamplingParams(n=1, response_length=response_length))
    return out, engine


def _texts(tok, out):
    return [tok.decode(r[m.bool()].tolist()) for r, m in zip(out["responses"], out["attention_mask"][:, -out["responses"].shape[1]:])]


def test_rows_at_different_turns_generate_together(tok):
    scripts = {"A:": [CALL, "done A"], "B:": ["done B"]}
    out, engine = _rollout(tok, scripts, [CalculatorTool()])
    assert engine.calls == [2, 1]  # turn 1: both rows; turn 2: only A, which called a tool
    texts = _texts(tok, out)
    assert "<tool_response>\n5535\n</tool_response>" in texts[0] and texts[0].endswith("done A<|im_end|>")
    assert texts[1] == "done B<|im_end|>"
    assert out.non_tensor_batch["multi_turn/tool_calls"].tolist() == [1, 0]


def test_the_tool_call_rate_column_is_there_only_where_tools_are_offered(tok):
    # with a tool: 1 for the row that called it, 0 for the other; the step's mean is the rate (0.5)
    out, _ = _rollout(tok, {"A:": [CALL, "done A"], "B:": ["done B"]}, [CalculatorTool()])
    assert out.non_tensor_batch["multi_turn/tool_call_rate"].tolist() == [1.0, 0.0]
    from posttrain.trainer.trainer import _extra_metrics
    from posttrain.rollout.multi_turn import multi_turn_columns

    assert _extra_metrics(multi_turn_columns(out))["multi_turn/tool_call_rate/mean"] == 0.5
    # no tool offered (a multi-turn run with an interaction only): no rate, rather than a rate of 0
    without, _ = _rollout(tok, {"A:": ["done A"]}, [])
    assert "multi_turn/tool_call_rate" not in without.non_tensor_batch


def _failing_tool(name: str, message: str) -> BaseTool:
    """A tool whose every call raises ``RuntimeError(message)``."""

    class Failing(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            raise RuntimeError(message)

    return Failing({}, {"type": "function", "function": {"name": name, "description": "x",
                                                        "parameters": {"type": "object", "properties": {}}}})


def test_failing_calls_become_messages(tok):
    boom = _failing_tool("boom", "disk on fire")
    calls = ('<tool_call>{"name": "boom", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>'
             '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>')
    out, _ = _rollout(tok, {"A:": [calls, "ok"]}, [boom, CalculatorTool()])
    text = _texts(tok, out)[0]
    assert "Error: boom failed: RuntimeError: disk on fire" in text
    assert "Error: the tool call is not valid JSON" in text
    assert "Error: missing required argument(s) ['expression'] for calculator" in text
    assert out.non_tensor_batch["multi_turn/tool_errors"].tolist() == [3]
    assert text.endswith("ok<|im_end|>")


def test_a_model_that_never_stops_calling_tools_ends_at_max_assistant_turns(tok):
    out, engine = _rollout(tok, {"A:": [CALL]}, [CalculatorTool()], response_length=2000, max_assistant_turns=3)
    cols = out.non_tensor_batch
    assert engine.calls == [1, 1, 1]
    assert (cols["multi_turn/assistant_turns"][0], cols["multi_turn/tool_calls"][0], cols["multi_turn/hit_turn_limit"][0]) == (3, 2, 1)
    # the trajectory ends on the model's turn: its last valid token is in the mask
    last = int(out["attention_mask"][0, -2000:].sum()) - 1
    assert out["response_mask"][0, last] == 1


def test_length_budget_ends_before_a_tool_turn_that_would_not_fit(tok):
    out, _ = _rollout(tok, {"A:": [CALL]}, [CalculatorTool()], response_length=len(CALL) + 20)
    cols = out.non_tensor_batch
    assert cols["multi_turn/hit_length_limit"][0] == 1 and cols["multi_turn/assistant_turns"][0] == 1
    assert out["response_mask"][0].sum() == len(CALL) + 1 and out["attention_mask"][0].sum() - out["prompts"].shape[1] == len(CALL) + 1


# ---------------------------------------------------------------- concurrency and time-outs
def _sleeper(log, seconds, name="nap"):
    class Sleeper(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            start = time.monotonic()
            await asyncio.sleep(seconds)
            log.append((start, time.monotonic()))
            return "slept", 0.0, {}

    return Sleeper({}, {"type": "function", "function": {"name": name, "description": "sleep",
                                                          "parameters": {"type": "object", "properties": {}}}})


NAP = '<tool_call>{"name": "nap", "arguments": {}}</tool_call>'


@pytest.mark.parametrize("parallel, overlapping", [(4, True), (1, False)])
def test_calls_overlap_up_to_max_parallel_calls(tok, parallel, overlapping):
    log = []
    scripts = {"A:": [NAP * 2, "a"], "B:": [NAP * 2, "b"]}
    _rollout(tok, scripts, [_sleeper(log, 0.3)], max_parallel_calls=parallel)
    assert len(log) == 4
    starts, ends = sorted(s for s, _ in log), sorted(e for _, e in log)
    if overlapping:  # all four started before the first one ended
        assert starts[-1] < ends[0]
    else:  # one at a time: each starts after the previous ended
        assert all(starts[i + 1] >= ends[i] for i in range(3))


def test_a_tool_past_its_time_out_answers_with_an_error(tok):
    log = []
    out, _ = _rollout(tok, {"A:": [NAP, "a"]}, [_sleeper(log, 5.0)], tool_timeout_s=0.2)
    assert "Error: nap did not answer within 0.2 s" in _texts(tok, out)[0]
    assert out.non_tensor_batch["multi_turn/tool_errors"].tolist() == [1] and log == []


def test_tool_rewards_and_interaction(tok):
    from posttrain.interactions.gsm8k_interaction import Gsm8kInteraction
    from posttrain.tools.gsm8k_tool import Gsm8kTool

    schema = {"type": "function", "function": {"name": "calc_gsm8k_reward", "description": "check",
              "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}
    engine = ScriptedEngine(tok, {"Q1:": ['<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "7"}}</tool_call>',
                                          "#### 7"],
                                  "Q2:": ["#### 3", "#### 4"]})
    loop = MultiTurnRollout(engine, tok, MultiTurnConfig(enable=True, max_user_turns=3), [Gsm8kTool({}, schema)],
                            {"gsm8k": Gsm8kInteraction({"name": "gsm8k"})})
    prompts = tiny_prompt_batch(tok, ["Q1:", "Q2:"])
    prompts.non_tensor_batch["extra_info"] = np.array([
        {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "7"}}}},
        {"interaction_kwargs": {"name": "gsm8k", "ground_truth": "4"}}], dtype=object)
    # Q2's second turn is chosen by the interaction's "try again" feedback in its context
    out = loop.generate(prompts, SamplingParams(n=1, response_length=400))
    cols = out.non_tensor_batch
    assert cols["multi_turn/tool_reward"].tolist() == [1.0, 0.0]  # calc_reward 1.0, step reward 0 (improved)
    assert cols["multi_turn/interaction_score"].tolist() == [0.0, 1.0]  # right on the second try
    texts = _texts(tok, out)
    assert "Your answer is not correct." in texts[1] and texts[1].endswith("#### 4<|im_end|>")
    assert cols["multi_turn/assistant_turns"].tolist() == [2, 2]


def test_a_final_answer_at_the_turn_limit_is_not_a_hit(tok):
    out, _ = _rollout(tok, {"A:": ["done"], "B:": [CALL]}, [CalculatorTool()], max_assistant_turns=1)
    assert out.non_tensor_batch["multi_turn/hit_turn_limit"].tolist() == [0, 1]
    assert out.non_tensor_batch["multi_turn/tool_calls"].tolist() == [0, 0]  # B's call past the limit is not run


def test_n_samples_per_prompt_share_its_uid(tok):
    engine = ScriptedEngine(tok, {"A:": ["a"], "B:": ["b"]})
    loop = MultiTurnRollout(engine, tok, MultiTurnConfig(enable=True), [CalculatorTool()])
    prompts = tiny_prompt_batch(tok, ["A:", "B:"])
    del prompts.non_tensor_batch["uid"]
    out = loop.generate(prompts, SamplingParams(n=2, response_length=16))
    uids = out.non_tensor_batch["uid"].tolist()
    assert len(out) == 4 and uids[0] == uids[1] != uids[2] == uids[3]
    assert _texts(tok, out) == ["a<|im_end|>", "a<|im_end|>", "b<|im_end|>", "b<|im_end|>"]


def test_the_reward_reads_each_turn_apart(tok):
    """The rule score decodes every valid response token (as verl): the model's turns stay separated by
    the user turns, so a final turn without '####' does not glue onto the previous answer's digits."""
    from posttrain.interactions.base import BaseInteraction
    from posttrain.rewards.manager import RewardManager

    class AlwaysAgain(BaseInteraction):
        async def generate_response(self, instance_id, messages, **kwargs):
            return False, "try again", 0.0, {}

    engine = ScriptedEngine(tok, {"A:": ["#### 44", "22 + 22 = 44"]})
    loop = MultiTurnRollout(engine, tok, MultiTurnConfig(enable=True, max_user_turns=1), [],
                            {"again": AlwaysAgain({"name": "again"})})
    prompts = tiny_prompt_batch(tok, ["A:"])
    prompts.non_tensor_batch["extra_info"] = np.array([{"interaction_kwargs": {"name": "again"}}], dtype=object)
    prompts.non_tensor_batch["data_source"] = np.array(["posttrain/arithmetic"], dtype=object)
    prompts.non_tensor_batch["reward_model"] = np.array([{"ground_truth": "44"}], dtype=object)
    out = loop.generate(prompts, SamplingParams(n=1, response_length=200))
    scores, _ = RewardManager(tok)(out)
    assert scores.sum().item() == 1.0  # "#### 44" then "22 + 22 = 44": 44, not 4422
    last = int(out["response_mask"][0].nonzero().max())
    assert scores[0, last] == 1.0  # on the last model token


# ---------------------------------------------------------------- guards: invalid calls, void turns, metrics
BAD = "<tool_call>{oops}</tool_call>"


def test_the_invalid_call_cap_ends_a_trajectory(tok):
    out, engine = _rollout(tok, {"A:": [BAD]}, [CalculatorTool()], response_length=2000, max_assistant_turns=6,
                           max_consecutive_invalid_tool_calls=2)
    cols = out.non_tensor_batch
    assert engine.calls == [1, 1]  # ended after the second invalid call in a row, before its error turn
    assert (cols["multi_turn/hit_invalid_call_limit"][0], cols["multi_turn/hit_turn_limit"][0]) == (1, 0)
    assert cols["multi_turn/invalid_tool_calls"][0] == 2 and cols["multi_turn/valid_tool_calls"][0] == 0
    last = int(out["attention_mask"][0, -2000:].sum()) - 1
    assert out["response_mask"][0, last] == 1  # it ends on the model's turn
    # negative control: without the cap the same model goes on to max_assistant_turns
    out, engine = _rollout(tok, {"A:": [BAD]}, [CalculatorTool()], response_length=2000, max_assistant_turns=6)
    assert engine.calls == [1] * 6 and out.non_tensor_batch["multi_turn/hit_invalid_call_limit"][0] == 0
    assert out.non_tensor_batch["multi_turn/invalid_tool_calls"][0] == 5


def test_a_valid_call_resets_the_invalid_run_and_a_failing_tool_does_not_count(tok):
    broken = _failing_tool("broken", "down")
    broken_call = '<tool_call>{"name": "broken", "arguments": {}}</tool_call>'
    out, _ = _rollout(tok, {"A:": [BAD, CALL, BAD, broken_call, BAD, "done"]}, [CalculatorTool(), broken],
                      max_consecutive_invalid_tool_calls=2)
    cols = out.non_tensor_batch
    assert _texts(tok, out)[0].endswith("done<|im_end|>") and cols["multi_turn/hit_invalid_call_limit"][0] == 0
    assert (cols["multi_turn/valid_tool_calls"][0], cols["multi_turn/invalid_tool_calls"][0]) == (2, 3)
    assert cols["multi_turn/tool_errors"][0] == 4  # three invalid calls and the failing tool


def test_tool_metrics_count_time_outs_kills_and_invalid_calls(tok):
    class Reporting(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            return "killed", 0.0, {"tool_error": 1.0, "sandbox_kill": parameters["cause"],
                                   "tool_timeout": float(parameters["cause"] == "timeout"),
                                   "invalid_tool_call": parameters["cause"] == "output"}

    schema = {"type": "function", "function": {"name": "run", "description": "x", "parameters": {
        "type": "object", "properties": {"cause": {"type": "string"}}, "required": ["cause"]}}}
    run = lambda cause: f'<tool_call>{{"name": "run", "arguments": {{"cause": "{cause}"}}}}</tool_call>'  # noqa: E731
    log = []
    out, _ = _rollout(tok, {"A:": [run("memory") + run("timeout") + run("memory") + run("output") + NAP, "ok"]},
                      [Reporting({}, schema), _sleeper(log, 5.0)], tool_timeout_s=0.2)
    cols = out.non_tensor_batch
    kills = {c: cols[f"multi_turn/sandbox_kills/{c}"][0] for c in ("timeout", "memory", "cpu", "output", "killed")}
    assert kills == {"timeout": 1, "memory": 2, "cpu": 0, "output": 1, "killed": 0}
    assert cols["multi_turn/sandbox_kills/file_size"][0] == cols["multi_turn/sandbox_kills/processes"][0] == 0
    assert cols["multi_turn/tool_timeouts"][0] == 2  # the tool's own, and the loop's time-out of the sleeper
    assert (cols["multi_turn/tool_calls"][0], cols["multi_turn/invalid_tool_calls"][0]) == (5, 1)
    assert cols["multi_turn/tool_errors"][0] == 5


@pytest.mark.parametrize("filtered", [True, False])
def test_void_turns_are_counted_and_filtered_on_request(tok, filtered):
    scripts = {"A:": [""], "B:": ["#### 4"], "C:": ["I think so."], "D:": [CALL, "#### 5535"]}
    out, _ = _rollout(tok, scripts, [CalculatorTool()], filter_void_turns=filtered, final_answer_pattern="####")
    cols = out.non_tensor_batch
    assert cols["multi_turn/void_turns"].tolist() == [1, 0, 1, 0]
    assert cols["multi_turn/void_filtered"].tolist() == ([1, 0, 1, 0] if filtered else [0, 0, 0, 0])
    model_tokens = out["response_mask"].sum(-1).tolist()
    assert (model_tokens[0] == 0 and model_tokens[2] == 0) == filtered  # zero loss weight only when filtered
    assert model_tokens[1] > 0 and model_tokens[3] > 0


def test_without_a_pattern_only_a_blank_turn_is_void(tok):
    out, _ = _rollout(tok, {"A:": [" "], "C:": ["I think so."]}, [CalculatorTool()])
    assert out.non_tensor_batch["multi_turn/void_turns"].tolist() == [1, 0]


@pytest.mark.parametrize("key, value, message", [
    ("max_consecutive_invalid_tool_calls", 0,
     "max_consecutive_invalid_tool_calls=0: expected an integer >= 1, or null"),
    ("final_answer_pattern", "([", "final_answer_pattern='([' is not a regular expression"),
])
def test_guard_keys_are_checked_at_start_up(key, value, message):
    from posttrain.errors import ConfigError
    from posttrain.rollout.multi_turn_checks import check_guards

    check_guards(MultiTurnConfig(enable=True, max_consecutive_invalid_tool_calls=3, final_answer_pattern="####"))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        check_guards(MultiTurnConfig(enable=True, **{key: value}))


def test_code_interpreter_in_a_rollout_with_a_tiny_model(tok, monkeypatch):
    """The real hf engine (its sampler scripted to call the tool) and verl's code interpreter on the local sandbox."""
    pytest.importorskip("posttrain.sandbox")
    from posttrain.tools.sandbox_fusion_tools import SandboxFusionTool
    from posttrain.workers.actor import ActorWorker

    cfg = tiny_worker_configs(response_length=240)
    actor = ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=tiny_llama(tok, seed=3), tokenizer=tok)
    tool = SandboxFusionTool({"default_timeout": 5})  # isolation auto (none as root is refused)
    loop = MultiTurnRollout(actor.rollout, tok, MultiTurnConfig(enable=True, max_assistant_turns=3), [tool])
    code_call = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(6*7)"}}</tool_call>'
    queue = _scripted_sampler(monkeypatch, tok, [code_call, "It is 42."])
    prompts = tiny_prompt_batch(tok, ["<|im_start|>user\n6*7?<|im_end|>\n<|im_start|>assistant\n"])
    out = loop.generate(prompts, SamplingParams(n=1, temperature=1.0, response_length=240))
    assert queue == []
    assert "<tool_response>\n42\n</tool_response>" in _texts(tok, out)[0]
    cols = out.non_tensor_batch
    assert (cols["multi_turn/valid_tool_calls"][0], cols["multi_turn/tool_errors"][0]) == (1, 0)


def test_a_tool_time_out_not_below_the_loops_is_warned_about(caplog):
    from posttrain.rollout.multi_turn_checks import _warn_on_slower_tools
    from posttrain.tools.sandbox_fusion_tools import SandboxFusionTool

    url = {"sandbox_fusion_url": "http://localhost:8080/run_code"}
    _warn_on_slower_tools([SandboxFusionTool({**url, "default_timeout": 10}), CalculatorTool()], 30.0)
    assert not caplog.records
    _warn_on_slower_tools([SandboxFusionTool({**url, "default_timeout": 30})], 30.0)
    assert "default_timeout=30 s is not below multi_turn.tool_timeout_s=30 s" in caplog.text
