"""A GenRM function as verl's docs write it trains on 2 Ray ranks (gloo, FSDP2, CPU): the judge is served by
the run itself, in the driver process (where rewards are computed), or with
``reward.reward_model.enable_resource_pool=True`` by a Ray actor holding a CPU of its own; each step's reward
is the judge's verdicts, and the run stops its judge at the end."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("httpx")
pytest.importorskip("starlette")

from helpers.tiny_run import tiny_config, tiny_model_dir  # noqa: E402

GENRM = '''
from posttrain.rewards.judge import chat_complete

CALLS = []


async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                        reward_model_tokenizer):
    messages = [{"role": "user", "content": f"Answer: {ground_truth}\\nSolution: {solution_str}\\nReply 0 or 1."}]
    result = await chat_complete(router_address=reward_router_address,
                                 chat_complete_request={"messages": messages, "temperature": 0.0, "max_tokens": 4})
    score = float(sum(map(ord, result.choices[0].message.content)) % 2)
    CALLS.append((reward_router_address, score))
    return score
'''


@pytest.fixture(scope="module")
def ray_cluster():
    # 3 logical CPUs: one per rank, one for the judge's own resource pool
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow  # two 2-rank runs (~3 min on 2 cores at load 10): `python -m pytest -m slow`
def test_genrm_trains_on_two_ranks_with_the_judge_in_the_driver_or_its_own_pool(tmp_path_factory, ray_cluster):
    from posttrain.trainer.trainer import RLTrainer

    base = tmp_path_factory.mktemp("genrm_ranks")
    fn = base / "genrm.py"
    fn.write_text(GENRM)
    judge_model = tiny_model_dir(base, seed=1)
    common = ["trainer.n_gpus_per_node=2", "trainer.total_training_steps=2", f"reward.custom_reward_function.path={fn}",
              "reward.reward_model.enable=True", f"reward.reward_model.model_path={judge_model}"]
    for name, extra, where in (
            ("driver", [], "served in this process"),
            ("pool", ["reward.reward_model.enable_resource_pool=True", "reward.reward_model.nnodes=1",
                      "reward.reward_model.n_gpus_per_node=1"], "served by a Ray actor of its own ({'num_cpus': 1})")):
        trainer = RLTrainer(tiny_config(tmp_path_factory.mktemp(name), common + extra))
        assert trainer.reward_fn.judge.where.startswith(where), trainer.reward_fn.judge.where
        address = trainer.reward_fn.judge.address
        calls = trainer.reward_fn.compute_score.fn.__globals__["CALLS"]
        calls.clear()
        history = trainer.fit()
        assert trainer.reward_fn.judge is None  # stopped with the run
        assert len(history) == 2 and len(calls) == 16 and {c[0] for c in calls} == {address}
        for step, row in enumerate(history):
            scores = [c[1] for c in calls[8 * step: 8 * step + 8]]
            assert row["critic/score/mean"] == pytest.approx(sum(scores) / 8)
            assert row["reward/judge_rows"] == 8 and row["reward/judge_failed_rows"] == 0
        if name == "pool":  # the actor is gone: its CPU is free again
            assert ray.available_resources().get("CPU", 0) >= 1
