"""GenRM as verl's docs write it, end to end in one process: an async reward function receiving
reward_router_address and reward_model_tokenizer, asking a `posttrain serve` server over a tiny model;
and a reward function whose judge never answers costs its time-out per row (the negative control, no
time-out anywhere, hangs)."""

from __future__ import annotations

import textwrap
import threading
import time

import pytest

pytest.importorskip("httpx")
pytest.importorskip("starlette")

from fake_judge import FakeJudge  # noqa: E402
from helpers.tiny_models import tiny_llama  # noqa: E402
from helpers.tokenizer import build_tiny_tokenizer  # noqa: E402
from test_reward_loop import TEXTS, TRUTHS, make_batch  # noqa: E402

from posttrain.rewards import judge as judge_module  # noqa: E402
from posttrain.rewards.functions import load_reward_function  # noqa: E402
from posttrain.rewards.loop import build_reward_manager  # noqa: E402
from posttrain.rollout import get_rollout_engine  # noqa: E402
from posttrain.serve.server import CompletionServer  # noqa: E402

GENRM = '''
from posttrain.rewards.judge import chat_complete

GRM_PROMPT_TEMPLATE = "Problem answer: {answer}\\nSolution: {solution}\\nScore the solution 0 or 1."
SEEN = []


async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                        reward_model_tokenizer):
    SEEN.append((reward_router_address, type(reward_model_tokenizer).__name__))
    grm_prompt = GRM_PROMPT_TEMPLATE.format(answer=ground_truth, solution=solution_str)
    messages = [{"role": "user", "content": grm_prompt}]
    sampling_params = {"temperature": 0.7, "top_p": 0.8, "max_tokens": 8}
    result = await chat_complete(router_address=reward_router_address,
                                 chat_complete_request={"messages": messages, **sampling_params})
    grm_response = result.choices[0].message.content.strip()
    try:
        score = int(grm_response.split("\\n\\n")[-1].strip())
    except Exception:
        score = 0
    return {"score": score, "judge_chars": len(grm_response)}
'''


def test_genrm_function_as_verl_writes_it_against_posttrain_serve(tmp_path):
    path = tmp_path / "genrm.py"
    path.write_text(GENRM)
    tok = build_tiny_tokenizer()
    engine = get_rollout_engine("hf", model=tiny_llama(tok).eval(), tokenizer=tok)
    fn = load_reward_function(str(path), "compute_score", genrm=True)
    assert fn.is_async
    with CompletionServer(engine, tok, model_name="judge") as server:
        manager = build_reward_manager(tok, compute_score=fn, reward_router_address=server.address,
                                       reward_model_tokenizer=tok, timeout_s=60)
        out = {}
        # the engine is held until the four rows' requests wait together: they decode as one batch
        with server.engine_lock:
            worker = threading.Thread(target=lambda: out.update(result=manager(make_batch(TEXTS, TRUTHS))))
            worker.start()
            deadline = time.monotonic() + 30
            while len(server.batcher._queue) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
        worker.join(60)
        scores, extra = out["result"]
        stats = dict(server.batcher.stats)
    seen = fn.fn.__globals__["SEEN"]
    assert seen == [(server.address, type(tok).__name__)] * 4
    # a random tiny model answers garbage: the function's own parser scores it 0, no row failed
    assert extra["reward/errors"].tolist() == [0.0] * 4 and scores.abs().sum() == 0
    assert all(0 <= n <= 8 for n in extra["judge_chars"])  # at most 8 tokens of one character each
    assert stats["requests"] == 4 and stats["batches"] == 1 and stats["largest_batch_rows"] == 4
    metrics = manager.step_metrics()
    assert metrics["reward/judge_rows"] == 4 and metrics["reward/judge_failed_rows"] == 0


ASKS_JUDGE = '''
from posttrain.rewards.judge import judge_for


async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                        reward_model_tokenizer):
    judge = judge_for(reward_router_address)
    return await judge.score([{"role": "user", "content": solution_str}])
'''


def _hanging_run(tmp_path, fake, judge_timeout, row_timeout, name):
    """A limit manager whose function asks the process's judge for ``fake``'s address (the judge's limits
    are the run's defaults, set before the step as a trainer sets them from its reward.* keys)."""
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(ASKS_JUDGE))
    tok = build_tiny_tokenizer()
    judge_module.set_default_limits(timeout_s=judge_timeout, retries=0, max_concurrent=4, on_error="zero",
                                    model="m")
    manager = build_reward_manager(tok, name="limit", compute_score=load_reward_function(str(path), genrm=True),
                                   reward_router_address=fake.address, reward_model_tokenizer=tok,
                                   timeout_s=row_timeout, on_error="zero", limits={"max_concurrent": 4})
    return manager, make_batch(TEXTS, TRUTHS)


@pytest.fixture(autouse=True)
def _default_judge_limits():
    yield
    judge_module.set_default_limits()


def test_a_judge_that_never_answers_costs_its_time_out_per_row(tmp_path):
    with FakeJudge("hang") as fake:
        manager, batch = _hanging_run(tmp_path, fake, judge_timeout=0.5, row_timeout=30, name="bounded")
        start = time.monotonic()
        scores, extra = manager(batch)
        wall = time.monotonic() - start
    assert 0.5 - 0.05 <= wall <= 0.5 + 1.0  # four rows side by side, one time-out each
    assert scores.abs().sum() == 0 and extra["reward/errors"].tolist() == [0.0] * 4  # the judge's zero: no crash
    metrics = manager.step_metrics()
    assert metrics["reward/judge_timeout"] == 4 and metrics["reward/judge_failed_rows"] == 4


def test_negative_control_without_any_time_out_the_step_hangs(tmp_path):
    with FakeJudge("hang") as fake:
        manager, batch = _hanging_run(tmp_path, fake, judge_timeout=None, row_timeout=None, name="unbounded")
        done = threading.Event()
        worker = threading.Thread(target=lambda: (manager(batch), done.set()), daemon=True)
        worker.start()
        worker.join(2.5)  # the watchdog: five times the bounded run's time-out
        hung = worker.is_alive()
        fake.release()  # the server answers 503 now; the rows fail (scored 0) and the step ends
        worker.join(15)
    assert hung and done.is_set()
