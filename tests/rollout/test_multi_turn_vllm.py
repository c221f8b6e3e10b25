"""The multi-turn agent loop on the vllm engine (marker ``vllm``): the same trajectories as on the hf
engine, token by token, on a tiny random model that an interaction keeps answering "try again" (a
random model never writes a tool call, so the user turns give the trajectories their turns)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.tiny_models import tiny_prompt_batch
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.config.actor_rollout_ref import MultiTurnConfig
from posttrain.interactions.base import BaseInteraction
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.hf import HFRolloutEngine
from posttrain.rollout.multi_turn import MultiTurnRollout
# this folder is on sys.path (no __init__)
from test_rollout_vllm import ENGINE, PROMPTS, fit_then_shut_down, vllm_llama, vllm_only, vllm_run_overrides


class AlwaysAgain(BaseInteraction):
    async def generate_response(self, instance_id, messages, **kwargs):
        return False, "try again", 0.0, {}


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _loop(engine, tok, user_turns):
    return MultiTurnRollout(engine, tok, MultiTurnConfig(enable=True, max_user_turns=user_turns), [],
                            {"again": AlwaysAgain({"name": "again"})})


def _prompts(tok):
    prompts = tiny_prompt_batch(tok, PROMPTS)
    prompts.non_tensor_batch["extra_info"] = np.array([{"interaction_kwargs": {"name": "again"}}] * len(PROMPTS),
                                                      dtype=object)
    return prompts


@vllm_only
def test_multi_turn_trajectories_equal_the_hf_engines(tok):
    """Greedy, three assistant turns per row separated by two user turns: responses, masks and
    attention masks equal; the model tokens' log-probs agree to 1e-4 (fp32 engine); user-turn tokens
    carry mask 0 and log-prob 0 on both."""
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    model = vllm_llama(tok, seed=1, eos_boost=3.0)
    engine = VLLMRolloutEngine(model, tok, config=ENGINE, seed=0)
    try:
        engine.update_weights(model)  # the engine starts from dummy weights
        sampling = SamplingParams(n=2, temperature=0.0, do_sample=False, response_length=160)
        got = _loop(engine, tok, user_turns=2).generate(_prompts(tok), sampling)
    finally:
        engine.shutdown()
    want = _loop(HFRolloutEngine(model, tok), tok, user_turns=2).generate(_prompts(tok), sampling)
    assert got.non_tensor_batch["multi_turn/turns"].tolist() == want.non_tensor_batch["multi_turn/turns"].tolist()
    assert max(want.non_tensor_batch["multi_turn/assistant_turns"].tolist()) == 3
    for key in ("responses", "response_mask", "attention_mask"):
        assert torch.equal(got[key], want[key]), key
    mask = want["response_mask"].bool()
    assert (~mask & want["attention_mask"][:, -mask.shape[1]:].bool()).any(), "the case needs user-turn tokens"
    torch.testing.assert_close(got["rollout_log_probs"], want["rollout_log_probs"], atol=1e-4, rtol=0)
    assert (got["rollout_log_probs"][~mask] == 0).all()


@vllm_only
def test_grpo_with_retry_turns_trains_on_the_vllm_engine(tmp_path, tok):
    """Two GRPO steps of the feedback-and-retry task with the vllm engine (fp32, weights pushed after each
    update): a random model answers wrong, the interaction says "try again", so trajectories have
    several turns; the engine's log-probs of the model tokens equal the trainer's."""
    from pathlib import Path

    from helpers.tiny_run import tiny_config
    from posttrain.data.arithmetic import write_arithmetic_parquet
    from posttrain.trainer.trainer import RLTrainer

    root = Path(__file__).resolve().parents[2]
    data_dir = tmp_path / "retry_data"
    write_arithmetic_parquet(str(data_dir), n_train=16, n_test=4, digits=1, ops=("+",), seed=0, prompt_style="retry")
    config = tiny_config(tmp_path, vllm_run_overrides(tok, tmp_path / "model", seed=7, eos_boost=3.0) + [
        f"data.train_files={data_dir / 'train.parquet'}", f"data.val_files={data_dir / 'test.parquet'}",
        "data.max_response_length=160", "actor_rollout_ref.rollout.multi_turn.enable=True",
        "actor_rollout_ref.rollout.multi_turn.max_user_turns=2",
        "actor_rollout_ref.rollout.multi_turn.interaction_config_path="
        f"{root / 'examples/interaction_config/arithmetic_interaction_config.yaml'}"])
    trainer = RLTrainer(config, tokenizer=tok)
    history = fit_then_shut_down(trainer)
    assert [r["step"] for r in history] == [1, 2]
    for row in history:
        assert row["multi_turn/assistant_turns/mean"] > 1.0, row["multi_turn/assistant_turns/mean"]
        assert row["training/rollout_actor_probs_diff_max"] < 1e-3
    mask = trainer.last_batch["response_mask"]
    attn = trainer.last_batch["attention_mask"][:, -mask.shape[1]:]
    assert ((attn == 1) & (mask == 0)).any()  # the "try again" turns: attended, not trained on
