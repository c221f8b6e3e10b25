"""The judge client cannot stall a run: a hanging judge costs its time-out per row (and, the negative
control, without a time-out it hangs), garbage and a dead server are counted by cause and scored per
on_error, retries recover a flaky server, limits hold, identical requests are asked once."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("httpx")

from fake_judge import FakeJudge, dead_url  # noqa: E402

from posttrain.rewards.judge import Judge, JudgeError, chat_complete, judge_for, normalize_base_url  # noqa: E402


def _ask(i: int) -> list[dict]:
    return [{"role": "user", "content": "x" * (i + 1)}]


async def _score_rows(judge: Judge, rows: int) -> list[float]:
    return await asyncio.gather(*(judge.score(_ask(i)) for i in range(rows)))


def test_scores_come_back_and_identical_requests_are_asked_once():
    with FakeJudge("ok") as fake:
        judge = Judge(fake.url, model="m", max_concurrent=4)
        assert asyncio.run(_score_rows(judge, 5)) == [1.0, 2.0, 3.0, 4.0, 5.0]  # "Score: <len>"
        # the same five again, plus five copies of one request at once: no new request reaches the server
        assert asyncio.run(_score_rows(judge, 5)) == [1.0, 2.0, 3.0, 4.0, 5.0]
        async def copies():
            return await asyncio.gather(*(judge.score(_ask(1)) for _ in range(5)))

        assert asyncio.run(copies()) == [2.0] * 5
        assert fake.requests == 5
        m = judge.metrics()
        assert m["reward/judge_requests"] == 5 and m["reward/judge_cache_hits"] == 10 and m["reward/judge_rows"] == 15
        assert m["reward/judge_failed_rows"] == 0
        assert fake.bodies[0]["model"] == "m" and fake.bodies[0]["temperature"] == 0.0


def test_a_hanging_judge_costs_its_time_out_per_row():
    timeout, rows, slots = 0.6, 6, 3
    with FakeJudge("hang") as fake:
        judge = Judge(fake.url, model="m", timeout_s=timeout, max_concurrent=slots, on_error="zero", error_score=-1.0)
        start = time.monotonic()
        scores = asyncio.run(_score_rows(judge, rows))
        wall = time.monotonic() - start
    assert scores == [-1.0] * rows
    # rows / slots waves of one time-out each: 1.2 s; at most one time-out per row even with no parallelism
    assert rows / slots * timeout - 0.05 <= wall <= rows / slots * timeout + 1.0, wall
    m = judge.metrics()
    assert m["reward/judge_timeout"] == rows and m["reward/judge_failed_rows"] == rows


def test_negative_control_without_a_time_out_the_judge_hangs():
    with FakeJudge("hang") as fake:
        judge = Judge(fake.url, model="m", timeout_s=None, retries=0)
        result = {}
        worker = threading.Thread(target=lambda: result.setdefault("score", judge.score_sync(_ask(0))), daemon=True)
        worker.start()
        worker.join(2.0)  # the watchdog: two seconds, far more than the time-out above
        still_waiting = worker.is_alive()
        fake.release()  # let it go (the server then answers 503, which is retried... with retries=0: fails)
        worker.join(10)
    assert still_waiting and not worker.is_alive()
    assert result["score"] == 0.0 and judge.metrics()["reward/judge_http_5xx"] == 1
    judge.close()


@pytest.mark.parametrize("mode, cause", [("garbage", "bad_response"), ("words", "unparsable"),
                                         ("500", "http_5xx"), ("429", "rate_limited")])
def test_bad_answers_are_counted_by_cause_and_scored_zero(mode, cause):
    with FakeJudge(mode) as fake:
        judge = Judge(fake.url, model="m", retries=2, backoff_s=0.01)
        assert asyncio.run(_score_rows(judge, 3)) == [0.0, 0.0, 0.0]
    m = judge.metrics()
    assert m[f"reward/judge_{cause}"] == 3 and m["reward/judge_failed_rows"] == 3
    retried = cause != "unparsable"  # an unreadable answer is not asked again
    assert fake.requests == (9 if retried else 3) and m["reward/judge_retries"] == (6 if retried else 0)


def test_a_dead_server_is_counted_and_raise_names_the_cause():
    url = dead_url()
    judge = Judge(url, model="m", retries=1, backoff_s=0.01)
    start = time.monotonic()
    assert asyncio.run(_score_rows(judge, 4)) == [0.0] * 4
    assert time.monotonic() - start < 5
    assert judge.metrics()["reward/judge_connect"] == 4
    strict = Judge(url, model="m", retries=0, on_error="raise")
    with pytest.raises(JudgeError) as info:
        asyncio.run(strict.score(_ask(0)))
    assert info.value.cause == "connect" and url in str(info.value) and "reward.on_error=zero" in str(info.value)


def test_retries_recover_a_flaky_server():
    with FakeJudge("flaky") as fake:  # odd requests fail with 500
        judge = Judge(fake.url, model="m", retries=1, backoff_s=0.01, max_concurrent=1)
        assert asyncio.run(_score_rows(judge, 3)) == [1.0, 2.0, 3.0]
    m = judge.metrics()
    assert fake.requests == 6 and m["reward/judge_retries"] == 3 and m["reward/judge_failed_rows"] == 0


def test_concurrency_and_rate_limits_hold():
    with FakeJudge("ok") as fake:
        in_flight, most = [0], [0]
        original = fake.server.RequestHandlerClass.do_POST

        def counting(handler):
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            time.sleep(0.05)
            try:
                original(handler)
            finally:
                in_flight[0] -= 1

        fake.server.RequestHandlerClass.do_POST = counting
        judge = Judge(fake.url, model="m", max_concurrent=2, cache_size=0)
        asyncio.run(_score_rows(judge, 8))
        assert most[0] == 2
        paced = Judge(fake.url, model="m", max_rps=10.0, max_concurrent=8, cache_size=0)
        start = time.monotonic()
        asyncio.run(_score_rows(paced, 6))
        assert time.monotonic() - start >= 0.5 - 0.02  # six starts at least 0.1 s apart


def test_verl_style_genrm_helper_and_addresses():
    assert normalize_base_url("127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert normalize_base_url("http://h:1") == "http://h:1/v1"
    assert normalize_base_url("https://api.example.com/v1/") == "https://api.example.com/v1"
    with FakeJudge("ok") as fake:
        result = asyncio.run(chat_complete(router_address=fake.address, chat_complete_request={
            "messages": [{"role": "user", "content": "abcd"}], "temperature": 0.7, "max_tokens": 16}))
        assert result.choices[0].message.content == "Score: 4"
        assert fake.bodies[0]["model"] == "fake-judge"  # no model given: the first one /models lists
        assert fake.bodies[0]["temperature"] == 0.7 and judge_for(fake.address) is judge_for(fake.url)
