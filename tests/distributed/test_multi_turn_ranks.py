"""Multi-turn batches through 2 Ray ranks (gloo, FSDP2): on the one-process run's replayed
trajectories (tool calls, tool tokens masked out of ``response_mask`` in the middle of the response,
per-row ``multi_turn/*`` columns), GRPO's rewards, losses and gradient norms equal one process's."""

from __future__ import annotations

import math

import pytest
import torch

ray = pytest.importorskip("ray")

from helpers.tiny_run import tiny_config  # noqa: E402
from posttrain.rollout import hf as hf_module  # noqa: E402

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
COMPARED = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean", "critic/advantages/max",
            "multi_turn/tool_calls/mean")


def lock_step_sampler(tok, turns):
    """Rows emit the same turns in lock-step, except the placeholder ``X``: a digit that depends on
    the row, so rewards differ within a group."""
    script = [t for turn in turns for t in tok.encode(turn, add_special_tokens=False) + [tok.eos_token_id]]
    placeholder = tok.convert_tokens_to_ids("X")
    digits = torch.tensor(tok.convert_tokens_to_ids(list("0123456789")))
    state = {"i": 0}

    def sample(logits, sampling, want_log_probs):
        t = script[state["i"] % len(script)]
        state["i"] += 1
        token = digits[torch.arange(logits.shape[0]) % 7] if t == placeholder else torch.full((logits.shape[0],), t)
        lp = torch.log_softmax(logits.float() / sampling.logprob_temperature, -1).gather(-1, token[:, None]).squeeze(-1)
        return token, (lp if want_log_probs else None)

    return sample


def reward(batch):
    """1 for an odd last model digit: differs between the samples of a prompt, the same on any rank."""
    last = [r[m.bool()][-2].item() for r, m in zip(batch["responses"], batch["response_mask"])]
    return torch.tensor([float(t % 2) for t in last])


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow  # a 2-rank engine run (~15-30 s on 2 Zen 3 cores): `python -m pytest -m slow`
def test_multi_turn_grpo_on_replayed_trajectories_equals_one_process(tmp_path_factory, ray_cluster, monkeypatch):
    from posttrain.trainer.trainer import RLTrainer

    tools = tmp_path_factory.mktemp("tools") / "tools.yaml"
    tools.write_text("tools:\n  - class_name: posttrain.tools.calculator_tool.CalculatorTool\n")
    common = ["actor_rollout_ref.rollout.n=4", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
              "actor_rollout_ref.actor.use_kl_loss=True", "trainer.total_training_steps=2", "data.max_response_length=160",
              "actor_rollout_ref.rollout.multi_turn.enable=True", f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}"]
    one = RLTrainer(tiny_config(tmp_path_factory.mktemp("mt1"), ["trainer.n_gpus_per_node=1", *common]))
    monkeypatch.setattr(hf_module, "_sample", lock_step_sampler(one.tokenizer, [CALL, "#### X"]))
    recorded = []
    generate = one.workers.generate_sequences
    one.workers.generate_sequences = lambda prompts, validate=False: recorded.append(generate(prompts)) or recorded[-1]
    one.reward_fn = reward
    one_history = one.fit()
    mask, attn = recorded[0]["response_mask"], recorded[0]["attention_mask"][:, -160:]
    assert ((attn == 1) & (mask == 0)).any()  # tool tokens inside the responses

    two = RLTrainer(tiny_config(tmp_path_factory.mktemp("mt2"), ["trainer.n_gpus_per_node=2", *common]))
    replay = iter(recorded)
    two.workers.generate_sequences = lambda prompts, validate=False: next(replay)
    two.reward_fn = reward
    two_history = two.fit()
    assert all(row["actor/grad_norm"] > 1e-3 and row["multi_turn/tool_calls/mean"] == 1.0 for row in one_history)
    for got, want in zip(two_history, one_history):
        for key in COMPARED:
            assert math.isclose(got[key], want[key], rel_tol=1e-4, abs_tol=1e-5), (got["step"], key, got[key], want[key])
