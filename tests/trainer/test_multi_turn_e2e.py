"""A tiny GRPO run with multi-turn rollouts and the calculator tool, end to end: the model (its
sampler scripted, as TRL's tests do) calls the calculator, reads the answer and finishes."""

import math

import pytest
import torch

from helpers.tiny_run import one_thread, tiny_trainer
from posttrain.rollout import hf as hf_module

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'


def _lock_step_sampler(monkeypatch, tok, turns):
    """Every row emits the same turns in lock-step (so no row leaves the decoding batch early), cycling."""
    script = [t for turn in turns for t in tok.encode(turn, add_special_tokens=False) + [tok.eos_token_id]]
    state = {"i": 0}

    def sample(logits, sampling, want_log_probs):
        token = torch.full((logits.shape[0],), script[state["i"] % len(script)])
        state["i"] += 1
        scores = logits.float() / (sampling.temperature if not sampling.greedy else 1.0)
        lp = torch.log_softmax(scores, -1).gather(-1, token[:, None]).squeeze(-1)
        return token, (lp if want_log_probs else None)

    monkeypatch.setattr(hf_module, "_sample", sample)


def test_grpo_with_the_calculator_tool_runs_two_steps(tmp_path, monkeypatch):
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: posttrain.tools.calculator_tool.CalculatorTool\n    config: {type: native}\n")
    trainer = tiny_trainer(tmp_path, [
        "trainer.total_training_steps=2", "data.max_response_length=192", "trainer.val_before_train=True",
        "actor_rollout_ref.rollout.multi_turn.enable=True", f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "actor_rollout_ref.rollout.multi_turn.add_tool_rewards=True",
        "actor_rollout_ref.actor.use_prefix_grouper=True"])  # as examples/multiply_tool.yaml
    _lock_step_sampler(monkeypatch, trainer.tokenizer, [CALL, "#### 5"])
    with one_thread():
        history = trainer.fit()
    val, history = history[0], history[1:]
    assert val["step"] == 0 and any(k.startswith("val-core/") for k in val)  # validation ran multi-turn too
    assert [row["step"] for row in history] == [1, 2]
    for row in history:
        assert row["multi_turn/tool_calls/mean"] == 1.0 and row["multi_turn/tool_errors/mean"] == 0.0
        assert row["multi_turn/assistant_turns/mean"] == 2.0 and row["multi_turn/hit_turn_limit/mean"] == 0.0
        assert all(math.isfinite(v) for v in row.values())
        assert row["training/rollout_actor_probs_diff_max"] < 1e-4  # model tokens: engine == actor
    batch = trainer.last_batch
    mask, attn = batch["response_mask"], batch["attention_mask"][:, -batch["responses"].shape[1]:]
    assert ((attn == 1) & (mask == 0)).any()  # tool tokens: attended, not trained on
    text = trainer.tokenizer.decode(batch["responses"][0][attn[0].bool()].tolist())
    assert "<tool_response>\n5\n</tool_response>" in text and text.endswith("#### 5<|im_end|>")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term.
        b: the second term.
    """
    return a + b


def test_python_api_tools_without_a_yaml(tmp_path, monkeypatch):
    from posttrain.errors import ConfigError

    trainer = tiny_trainer(tmp_path, ["trainer.total_training_steps=1", "data.max_response_length=160",
                                      "actor_rollout_ref.rollout.multi_turn.enable=True"])
    trainer.tools = [add]
    assert [t.name for t in trainer.tools] == ["add"]
    _lock_step_sampler(monkeypatch, trainer.tokenizer,
                       ['<tool_call>{"name": "add", "arguments": {"a": 40, "b": 2}}</tool_call>', "#### 42"])
    with one_thread():
        (row,) = trainer.fit()
    assert row["multi_turn/tool_calls/mean"] == 1.0 and row["multi_turn/tool_errors/mean"] == 0.0
    batch = trainer.last_batch
    text = trainer.tokenizer.decode(batch["responses"][0][batch["attention_mask"][0, -160:].bool()].tolist())
    assert "<tool_response>\n42\n</tool_response>" in text

    def undocumented(a: int):
        return a

    with pytest.raises(ConfigError, match="undocumented has no docstring"):
        trainer.tools = [undocumented]
