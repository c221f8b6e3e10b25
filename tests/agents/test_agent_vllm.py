"""Agent episodes on the vllm engine (marker ``vllm``; runs where vLLM is importable): the endpoint serves the
run's vLLM engine, the plain `openai` client's calls are sampled by it, and GRPO trains on the recorded tokens
as it does on the hf engine (`test_agent_training.py`)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("starlette")

sys.path.insert(0, str(Path(__file__).parents[1] / "rollout"))  # the vllm helpers live beside the engine's tests
from test_rollout_vllm import fit_then_shut_down, vllm_only, vllm_run_overrides  # noqa: E402

from helpers.tiny_run import tiny_config  # noqa: E402
from helpers.tokenizer import build_tiny_tokenizer  # noqa: E402

HARNESSES = str(Path(__file__).with_name("harnesses.py"))
EPISODE = "actor_rollout_ref.rollout.agent.episode"


@vllm_only
@pytest.mark.parametrize("name, splits", [("append", False), ("rewrite", True)])
def test_grpo_trains_an_agent_through_the_endpoint_on_vllm(tmp_path, name, splits):
    from posttrain.trainer.trainer import RLTrainer

    tok = build_tiny_tokenizer()
    overrides = vllm_run_overrides(tok, tmp_path / "model", seed=7) + [
        f"{EPISODE}.path={HARNESSES}", f"{EPISODE}.name={name}", "data.return_raw_chat=True",
        "data.max_response_length=128"]
    trainer = RLTrainer(tiny_config(tmp_path, overrides), tokenizer=tok)
    history = fit_then_shut_down(trainer)
    assert [r["step"] for r in history] == [1, 2]
    for step in history:
        assert step["agent/episodes"] == 8 and step["agent/failed"] == 0
        assert step["agent/calls"] == 24  # three calls an episode, each sampled by vLLM through the endpoint
        assert math.isfinite(step["actor/pg_loss"]) and step["actor/grad_norm"] > 0
        # vLLM's log-probs of the sampled tokens against the trainer's recomputation (same weights, fp32)
        assert step["training/rollout_actor_probs_diff_max"] < 1e-2
        if splits:
            assert step["agent/splits/history_rewritten"] >= 5 and step["agent/retokenized_tokens"] > 0
        else:  # the negative control: the same harness appending its history
            assert step["agent/retokenized_tokens"] == 0 and step["agent/sequences"] == 8
    rewards = trainer.last_batch.non_tensor_batch["agent/reward"]
    assert trainer.last_batch["token_level_scores"].sum(-1).tolist() == pytest.approx(list(rewards))


@vllm_only
@pytest.mark.slow  # a 2-rank run with an engine per rank: `python -m pytest -m slow`
def test_agent_grpo_on_two_ray_ranks_on_vllm(tmp_path):
    ray = pytest.importorskip("ray")
    from posttrain.trainer.trainer import RLTrainer

    tok = build_tiny_tokenizer()
    overrides = vllm_run_overrides(tok, tmp_path / "model", seed=7) + [
        "trainer.n_gpus_per_node=2", f"{EPISODE}.path={HARNESSES}", f"{EPISODE}.name=rewrite",
        "data.return_raw_chat=True", "data.max_response_length=128", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.total_training_steps=1"]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        trainer = RLTrainer(tiny_config(tmp_path, overrides), tokenizer=tok)
        (step,) = trainer.fit()
    finally:
        ray.shutdown()
    assert step["agent/episodes"] == 8 and step["agent/calls"] == 24 and step["agent/failed"] == 0
    assert math.isfinite(step["actor/pg_loss"]) and step["actor/grad_norm"] > 0
    assert step["agent/splits/history_rewritten"] >= 4 and step["agent/retokenized_tokens"] > 0
    assert sorted(set(trainer.last_batch.non_tensor_batch["agent/episode"])) == list(range(8))
