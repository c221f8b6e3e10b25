"""`posttrain serve` through the official `openai` client, over the hf engine and a tiny random model.

What is checked with numbers: the server's tokens and log-probs are the engine's own for the same
prompt; concurrent requests decode in one batch and give the tokens each gives alone; a seed gives the
same sample whatever else runs; n / max_tokens / stop / completions' prompt forms; each refusal's
status and code; the recorder's ids; the command line serving a saved model.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from helpers.tiny_models import tiny_llama  # noqa: E402
from helpers.tokenizer import build_tiny_tokenizer  # noqa: E402

from posttrain.rollout import SamplingParams, get_rollout_engine  # noqa: E402
from posttrain.serve.server import CompletionServer  # noqa: E402

KEY = "test-key"


@pytest.fixture(scope="module")
def tiny():
    tok = build_tiny_tokenizer()
    model = tiny_llama(tok).eval()
    return get_rollout_engine("hf", model=model, tokenizer=tok), tok


@pytest.fixture()
def served(tiny):
    engine, tok = tiny
    records = []
    with CompletionServer(engine, tok, model_name="tiny", api_key=KEY, recorder=records.append,
                          default_max_tokens=16) as server:
        client = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)
        yield server, client, records


def _engine_greedy(engine, tok, text: str, max_tokens: int):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    prompts = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    from posttrain.batch import Batch

    out = engine.generate(Batch.from_dict(prompts), SamplingParams(do_sample=False, temperature=0.0,
                                                                   response_length=max_tokens))
    n = int(out["response_mask"][0].sum())
    return out["responses"][0, :n].tolist(), out["rollout_log_probs"][0, :n].tolist()


def _chat_prompt(tok, content: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)


def test_chat_tokens_and_log_probs_are_the_engines(served, tiny):
    server, client, records = served
    engine, tok = tiny
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+1="}], max_tokens=12,
                                       temperature=0, logprobs=True)
    want_ids, want_lps = _engine_greedy(engine, tok, _chat_prompt(tok, "1+1="), 12)
    extra = r.choices[0].model_extra
    assert extra["token_ids"] == want_ids and len(want_ids) == 12
    got_lps = [c.logprob for c in r.choices[0].logprobs.content]
    assert got_lps == pytest.approx(want_lps, abs=1e-6)
    assert r.choices[0].message.content == tok.decode(want_ids, skip_special_tokens=True)
    assert r.choices[0].finish_reason == "length"
    assert r.model_extra["prompt_token_ids"] == tok(_chat_prompt(tok, "1+1="), add_special_tokens=False)["input_ids"]
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(r.model_extra["prompt_token_ids"])
    # the recorder saw the same ids and log-probs
    rec = records[-1]
    assert rec.key == KEY and rec.prompt_token_ids[0] == r.model_extra["prompt_token_ids"]
    assert rec.choices[0][0].token_ids == want_ids and rec.choices[0][0].log_probs == pytest.approx(want_lps, abs=1e-6)


def test_concurrent_requests_decode_together_and_match_one_at_a_time(served):
    server, client, _ = served
    questions = [f"{a}+{b}=" for a, b in zip(range(7), range(3, 10))]

    def ask(q):
        return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}], max_tokens=10,
                                              temperature=0).choices[0].message.content

    alone = [ask(q) for q in questions]
    before = dict(server.batcher.stats)
    results: dict[int, str] = {}
    # the engine is held while all seven arrive: they wait, and decode as one batch once it is free
    with server.engine_lock:
        threads = [threading.Thread(target=lambda i=i, q=q: results.__setitem__(i, ask(q)))
                   for i, q in enumerate(questions)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(server.batcher._queue) < len(questions) and time.monotonic() < deadline:
            time.sleep(0.01)
    for t in threads:
        t.join(60)
    assert [results[i] for i in range(len(questions))] == alone
    assert server.batcher.stats["batches"] - before["batches"] == 1
    assert server.batcher.stats["largest_batch_rows"] == len(questions)


def test_n_max_tokens_stop_and_seed(served, tiny):
    server, client, _ = served
    engine, tok = tiny
    ask = dict(model="tiny", messages=[{"role": "user", "content": "hello"}])
    r = client.chat.completions.create(**ask, n=3, max_tokens=7, temperature=1.0, seed=11)
    assert len(r.choices) == 3 and [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices) and r.usage.completion_tokens == 21
    again = client.chat.completions.create(**ask, n=3, max_tokens=7, temperature=1.0, seed=11)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    other = client.chat.completions.create(**ask, n=3, max_tokens=7, temperature=1.0, seed=12)
    assert [c.message.content for c in other.choices] != [c.message.content for c in r.choices]
    # stop: the greedy text cut before the stop string's first occurrence
    full = client.chat.completions.create(**ask, max_tokens=16, temperature=0).choices[0].message.content
    stop = full[5:7]
    cut = client.chat.completions.create(**ask, max_tokens=16, temperature=0, stop=[stop], logprobs=True).choices[0]
    assert cut.message.content == full[:full.find(stop)] and cut.finish_reason == "stop"
    ids = cut.model_extra["token_ids"]  # the tokens up to the one that completed the stop string
    assert tok.decode(ids) == full[:full.find(stop) + len(stop)] and len(cut.logprobs.content) == len(ids)


def test_completions_prompt_forms_and_logprobs(served, tiny):
    server, client, _ = served
    engine, tok = tiny
    ids = tok("2*3=", add_special_tokens=False)["input_ids"]
    r = client.completions.create(model="tiny", prompt=["2*3=", ids], max_tokens=6, temperature=0, logprobs=0, n=2)
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len({c.text for c in r.choices}) == 1  # greedy: both prompts are the same tokens, both samples equal
    want_ids, want_lps = _engine_greedy(engine, tok, "2*3=", 6)
    c = r.choices[3]
    assert c.model_extra["token_ids"] == want_ids and c.model_extra["prompt_token_ids"] == ids
    assert c.logprobs.token_logprobs == pytest.approx(want_lps, abs=1e-6)
    assert "".join(c.logprobs.tokens) == tok.decode(want_ids) and c.logprobs.text_offset[0] == 0


def test_streaming_gives_the_same_text(served):
    server, client, _ = served
    ask = dict(model="tiny", messages=[{"role": "user", "content": "abc"}], max_tokens=9, temperature=0)
    whole = client.chat.completions.create(**ask).choices[0].message.content
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole and chunks[-1].usage.completion_tokens == 9
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


@pytest.mark.parametrize("kwargs, status, code", [
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}], tool_choice="required"), 400,
     "unsupported_parameter"),
    (dict(logit_bias={"5": 10}), 400, "unsupported_parameter"),
    (dict(top_logprobs=2, logprobs=True), 400, "unsupported_parameter"),
    (dict(extra_body={"mirostat": 1}), 400, "unsupported_parameter"),
    (dict(temperature=3.5), 400, None),
    (dict(max_tokens=10_000), 400, "context_length_exceeded"),
    (dict(model="gpt-4o"), 404, "model_not_found"),
])
def test_refusals_are_one_json_error(served, kwargs, status, code):
    server, client, _ = served
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**ask)
    assert info.value.status_code == status
    error = info.value.body
    assert isinstance(error, dict) and error.get("code") == code and error.get("message")
    # a harmless value of an unsupported field (no penalty, no tools) is accepted
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                   presence_penalty=0, tool_choice="none")


def test_keys_models_routes_and_the_default_host(served):
    server, client, _ = served
    assert server.host == "127.0.0.1" and server.url == f"http://127.0.0.1:{server.port}/v1"
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
    import httpx

    r = httpx.get(f"{server.url}/models")  # no key at all
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"http://{server.address}/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.post(f"{server.url}/chat/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    assert httpx.get(f"http://{server.address}/health").json()["status"] == "ok"


class _FailingOnce:
    """An engine whose first call fails: that batch's requests get HTTP 500, later ones are served."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0
        self.model, self.eos_token_ids = engine.model, engine.eos_token_ids

    def generate(self, prompts, sampling):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("out of memory (simulated)")
        return self.engine.generate(prompts, sampling)


def test_an_engine_failure_fails_its_batch_not_the_server(tiny):
    engine, tok = tiny
    with CompletionServer(_FailingOnce(engine), tok, model_name="tiny") as server:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="tiny", prompt="ab", max_tokens=3)
        assert "out of memory (simulated)" in info.value.body["message"]
        assert len(client.completions.create(model="tiny", prompt="ab", max_tokens=3).choices) == 1


def test_command_line_serves_a_saved_model(tmp_path, tiny):
    engine, tok = tiny
    engine.model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "serve", str(tmp_path / "m"), "--port", "0",
                             "--served-model-name", "saved", "--api-key", "k2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "http://" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, line
        url = line.split(" at ")[1].split(";")[0]
        client = openai.OpenAI(base_url=url, api_key="k2", max_retries=0)
        r = client.chat.completions.create(model="saved", messages=[{"role": "user", "content": "1+1="}],
                                           max_tokens=12, temperature=0, logprobs=True)
        want_ids, _ = _engine_greedy(engine, tok, _chat_prompt(tok, "1+1="), 12)
        assert r.choices[0].model_extra["token_ids"] == want_ids
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_model_that_does_not_load_is_one_error_line(tmp_path, capsys):
    from posttrain.cli import main

    assert main(["serve", str(tmp_path / "no_model_here")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: posttrain serve") and "cannot load the model" in err[0]
