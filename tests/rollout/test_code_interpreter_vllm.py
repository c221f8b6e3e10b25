"""The code interpreter on the vllm engine (marker ``vllm``): a tiny model taught, by 60 supervised
steps, to answer any prompt with one code_interpreter call; one multi-turn rollout on vLLM runs
its code in the local sandbox and reads the answer back, token for token as on the hf engine."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_models import tiny_prompt_batch
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.config.actor_rollout_ref import MultiTurnConfig
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.hf import HFRolloutEngine
from posttrain.rollout.multi_turn import MultiTurnRollout
# this folder is on sys.path (no __init__)
from test_rollout_vllm import ENGINE, vllm_llama, vllm_only

CALL = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(6*7)"}}</tool_call>'
TAUGHT_ON = ["x", "1+1=", "what is 4+5? ", "hello", "6*7?", "run it", "compute", "a b c"]
ASKED = ["6*7?", "x"]  # taught prompts: the test is about the engine and the tool, not generalisation


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def prompt_text(tok, question: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


def teach_the_call(tok, steps: int = 60):
    """A tiny Llama that answers every prompt with CALL and end-of-turn: full-batch Adam on the taught
    prompts, loss on the answer only (the loss is ~1e-3 by step 50)."""
    model = vllm_llama(tok, seed=3)
    answer = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    prompts = [tok(prompt_text(tok, q), add_special_tokens=False)["input_ids"] for q in TAUGHT_ON]
    width = max(len(p) for p in prompts) + len(answer)
    ids = torch.full((len(prompts), width), tok.pad_token_id)
    labels, attention = torch.full_like(ids, -100), torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        end = len(prompt) + len(answer)
        ids[row, :end] = torch.tensor(prompt + answer)
        attention[row, :end] = 1
        labels[row, len(prompt):end] = torch.tensor(answer)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def rollout(engine, tok, tool):
    config = MultiTurnConfig(enable=True, max_assistant_turns=2, format="hermes")
    loop = MultiTurnRollout(engine, tok, config, [tool])
    sampling = SamplingParams(n=1, temperature=0.0, do_sample=False, response_length=256)
    return loop.generate(tiny_prompt_batch(tok, [prompt_text(tok, q) for q in ASKED]), sampling)


@vllm_only
def test_one_multi_turn_step_with_the_code_interpreter_on_vllm(tok):
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine
    from posttrain.tools.sandbox_fusion_tools import SandboxFusionTool

    untaught = vllm_llama(tok, seed=3)
    model = teach_the_call(tok)
    tool = SandboxFusionTool({"default_timeout": 10})  # the local sandbox, its isolation as this machine allows
    engine = VLLMRolloutEngine(untaught, tok, config=dict(ENGINE, max_model_len=400), seed=0)
    try:
        engine.update_weights(untaught)  # the engine starts from dummy weights
        control = rollout(engine, tok, tool)
        engine.update_weights(model)
        got = rollout(engine, tok, tool)
    finally:
        engine.shutdown()
    # negative control: the same model before teaching never calls the tool
    assert control.non_tensor_batch["multi_turn/tool_calls"].tolist() == [0, 0]
    cols = got.non_tensor_batch
    assert min(cols["multi_turn/tool_calls"]) >= 1
    assert sum(cols["multi_turn/tool_errors"]) == 0 and sum(cols["multi_turn/invalid_tool_calls"]) == 0
    for row in range(len(ASKED)):
        mask = got["response_mask"][row].bool()
        ids = got["responses"][row]
        trained = tok.decode(ids[mask], skip_special_tokens=True)
        told = tok.decode(ids[~mask & got["attention_mask"][row, -mask.shape[0]:].bool()], skip_special_tokens=True)
        assert trained.startswith(CALL), trained  # the model's call: trained on
        assert "42" in told and "42" not in trained  # what the sandbox printed: read, not trained on
    # the same trajectories on the hf engine (the same model, greedy): tokens, masks and tool counts
    want = rollout(HFRolloutEngine(model, tok), tok, tool)
    for key in ("responses", "response_mask", "attention_mask"):
        assert torch.equal(got[key], want[key]), key
    assert got.non_tensor_batch["multi_turn/tool_calls"].tolist() == want.non_tensor_batch["multi_turn/tool_calls"].tolist()
    torch.testing.assert_close(got["rollout_log_probs"], want["rollout_log_probs"], atol=1e-4, rtol=0)

