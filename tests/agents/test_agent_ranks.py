"""Agent episodes on 2 Ray ranks (gloo, FSDP2, hf engine): each rank serves its share of the episodes over
its own engine; the driver joins the ranks' rows (a row's sequences vary with splits, prompt widths too)
and sums their counts. The negative control of the splits is the appending harness, as in one process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("openai")
pytest.importorskip("starlette")

from helpers.tiny_run import tiny_config  # noqa: E402

HARNESSES = str(Path(__file__).with_name("harnesses.py"))
EPISODE = "actor_rollout_ref.rollout.agent.episode"


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow  # a 2-rank run: `python -m pytest -m slow`
@pytest.mark.parametrize("name", ["append", "rewrite"])
def test_agent_grpo_on_two_ranks(tmp_path, ray_cluster, name):
    from posttrain.trainer.trainer import RLTrainer

    # 3 prompts on 2 ranks: the second rank's chunk is padded with a copy, whose episodes are dropped
    config = tiny_config(tmp_path, ["trainer.n_gpus_per_node=2", f"{EPISODE}.path={HARNESSES}", f"{EPISODE}.name={name}",
                                    "data.return_raw_chat=True", "data.max_response_length=128",
                                    "data.train_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
                                    "trainer.total_training_steps=1"])
    trainer = RLTrainer(config)
    (step,) = trainer.fit()
    batch = trainer.last_batch
    assert step["agent/episodes"] == 6 and step["agent/calls"] == 18 and step["agent/failed"] == 0
    assert math.isfinite(step["actor/pg_loss"]) and step["actor/grad_norm"] > 0
    assert sorted(set(batch.non_tensor_batch["agent/episode"])) == list(range(6))
    assert len(set(batch.non_tensor_batch["uid"])) == 3
    if name == "append":
        assert step["agent/retokenized_tokens"] == 0 and step["agent/sequences"] == 6 == len(batch)
    else:
        assert step["agent/splits/history_rewritten"] >= 3 and step["agent/retokenized_tokens"] > 0
        assert step["agent/sequences"] == 6 + step["agent/splits/history_rewritten"] == len(batch)
