"""examples/judge_reward.py, the built-in judge example's GenRM function, against a fake judge: the score is the
judge's answer alone (never the ground truth), a prompt's responses share one request (the judge's cache),
and the agreement figures of examples/judge_agreement.py count what they say."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")

from fake_judge import FakeJudge  # noqa: E402

from posttrain.rewards import judge as judge_module  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _default_judge_limits():
    judge_module.set_default_limits(timeout_s=10, retries=0, on_error="zero", model="fake")
    yield
    judge_module.set_default_limits()


def test_solve_style_scores_agreement_with_the_judges_own_answer(monkeypatch):
    example = _load("judge_reward")
    monkeypatch.setattr(example, "STYLE", "solve")
    question = "What is 47 + 38?"  # the fake judge answers "Score: 16": the length of the question it was asked

    async def score(text, truth):
        return await example.compute_score("posttrain/arithmetic", text, truth, {"question": question},
                                           reward_router_address=fake.address, reward_model_tokenizer=None)

    with FakeJudge("ok") as fake:
        async def all_rows():
            return await asyncio.gather(score("47 + 38 = 16\n#### 16", "85"), score("#### 85", "85"),
                                        score("no number", "85"), score("1,6 or 16", "0"))

        out = asyncio.run(all_rows())
        requests = fake.requests
    # the judge says 16: agreeing with it scores 1 whatever the ground truth (85, 0) says
    assert [o["score"] for o in out] == [1.0, 0.0, 0.0, 1.0]
    assert requests == 1  # four responses to one question: one request, the others from the judge's cache
    assert fake.bodies[0]["messages"][-1] == {"role": "user", "content": question}
    assert fake.bodies[0]["temperature"] == 0.0


def test_verdict_style_reads_yes(monkeypatch):
    example = _load("judge_reward")
    monkeypatch.setattr(example, "STYLE", "verdict")
    with FakeJudge("words") as fake:  # "I cannot judge this.": not a yes
        out = asyncio.run(example.compute_score("s", "#### 85", "85", {"question": "What is 47 + 38?"},
                                                reward_router_address=fake.address, reward_model_tokenizer=None))
        body = fake.bodies[0]
    assert out["score"] == 0.0 and "Answer: #### 85" in body["messages"][0]["content"]


def test_agreement_figures():
    agreement = _load("judge_agreement").agreement
    # rule 1 1 0 0, judge 1 0 1 0: agree on 2 of 4; precision 1/2, recall 1/2
    assert agreement([1, 1, 0, 0], [1, 0, 1, 0]) == {"agreement": 0.5, "precision": 0.5, "recall": 0.5,
                                                     "judge_positive": 0.5, "rule_positive": 0.5}
