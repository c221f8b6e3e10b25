"""Agent episodes in a run: GRPO trains through the endpoint in one process (hf engine, tiny model, CPU),
with the step's agent metrics; a harness that rewrites history trains too, its splits counted; a config
that names no episode function is one line before any model loads."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("starlette")

from helpers.tiny_run import one_thread, tiny_config  # noqa: E402

from posttrain.config import ConfigError  # noqa: E402
from posttrain.trainer.trainer import RLTrainer  # noqa: E402

HARNESSES = str(Path(__file__).with_name("harnesses.py"))
EPISODE = "actor_rollout_ref.rollout.agent.episode"


def _agent_run(tmp_path, name, *extra):
    return tiny_config(tmp_path, [f"{EPISODE}.path={HARNESSES}", f"{EPISODE}.name={name}", "data.return_raw_chat=True",
                                  "data.max_response_length=128", "trainer.total_training_steps=2", *extra])


@pytest.mark.parametrize("name, splits, extra", [
    ("append", False, []), ("rewrite", True, []),
    # one mini-batch of the whole batch (old log-probs from the update's own forward), but the splits add
    # rows: they are recomputed instead
    ("rewrite", True, ["actor_rollout_ref.actor.ppo_mini_batch_size=4"])])
def test_grpo_trains_an_agent_through_the_endpoint(tmp_path, name, splits, extra):
    with one_thread():
        trainer = RLTrainer(_agent_run(tmp_path, name, *extra))
        history = trainer.fit()
        batch = trainer.last_batch
    assert len(history) == 2
    for step in history:
        assert step["agent/episodes"] == 8 and step["agent/failed"] == 0 and step["agent/hit_length_limit"] == 0
        assert step["agent/calls"] == 24
        assert math.isfinite(step["actor/pg_loss"]) and step["actor/grad_norm"] > 0
        # the trainer's recomputed log-probs of the sampled tokens match the engine's (same weights, fp32)
        assert step["training/rollout_actor_probs_diff_max"] < 1e-3
        if splits:
            assert step["agent/splits/history_rewritten"] >= 5 and step["agent/retokenized_tokens"] > 0
            assert step["agent/sequences"] == 8 + step["agent/splits/history_rewritten"]
        else:  # the negative control: the same harness appending its history
            assert step["agent/retokenized_tokens"] == 0 and step["agent/sequences"] == 8
            assert step["agent/splits/history_rewritten"] == step["agent/splits/reply_rewritten"] == 0
    # the step's scores are the episodes' rewards; a group is the episodes of one row
    rewards = batch.non_tensor_batch["agent/reward"]
    assert batch["token_level_scores"].sum(-1).tolist() == pytest.approx(list(rewards))
    assert len(set(batch.non_tensor_batch["uid"])) == 4


@pytest.mark.parametrize("overrides, message", [
    ([f"{EPISODE}.path=/nonexistent/agent.py"], "file not found"),
    ([f"{EPISODE}.path={HARNESSES}", f"{EPISODE}.name=missing"], "is not defined in"),
    ([f"{EPISODE}.path={HARNESSES}", f"{EPISODE}.name=CALCULATOR"], "is not an async function"),
    ([f"{EPISODE}.path={HARNESSES}", "data.return_raw_chat=False"], "data.return_raw_chat=True"),
    ([f"{EPISODE}.path={HARNESSES}", "actor_rollout_ref.rollout.multi_turn.enable=True"], "choose one"),
    ([f"{EPISODE}.path={HARNESSES}", f"{EPISODE}.command=echo 1"], "not both"),
    # timeout_s=0 is refused when the config loads, as every time-out's 0 is (tests/config/test_ranges.py)
    ([f"{EPISODE}.path={HARNESSES}", "actor_rollout_ref.hybrid_engine=False", "actor_rollout_ref.rollout.nnodes=1",
      "actor_rollout_ref.rollout.n_gpus_per_node=1"], "hybrid_engine=True"),
])
def test_a_config_naming_no_episode_is_one_line_before_loading(tmp_path, monkeypatch, overrides, message):
    import posttrain.trainer.setup as setup

    def no_models(*args, **kwargs):
        raise AssertionError("models were loaded")

    monkeypatch.setattr(setup, "build_workers", no_models)
    config = tiny_config(tmp_path, ["data.return_raw_chat=True", *overrides])
    with pytest.raises(ConfigError, match=message) as err:
        RLTrainer(config)
    assert "\n" not in str(err.value)
