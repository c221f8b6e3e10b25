"""Agent episodes through the OpenAI endpoint, over the hf engine and a tiny random model (CPU).

Checked with numbers against what the official ``openai`` client saw (tests/agents/harnesses.py records
every reply's ids and log-probs per API key): the batch's sampled tokens are those ids, in order, exactly
where ``response_mask`` is 1; its log-probs are the replies' and the model's own recomputed ones; an
appending harness has no split and no retokenised token, one that drops a reply's text splits once per
episode (its count derived from what it sent); failures are counted per cause and never end the rollout.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("openai")
pytest.importorskip("starlette")

from helpers.tiny_models import tiny_llama  # noqa: E402
from helpers.tokenizer import build_tiny_tokenizer  # noqa: E402

from posttrain.agents.rollout import AgentRollout, agent_scores, agent_step_metrics  # noqa: E402
from posttrain.config.actor_rollout_ref import AgentEpisodeConfig  # noqa: E402
from posttrain.data.rl_dataset import collate_prompts  # noqa: E402
from posttrain.models import compute_response_logprobs  # noqa: E402
from posttrain.rollout import SamplingParams, get_rollout_engine  # noqa: E402

HARNESSES = str(Path(__file__).with_name("harnesses.py"))


@pytest.fixture(scope="module")
def tiny():
    tok = build_tiny_tokenizer()
    model = tiny_llama(tok).eval()
    return get_rollout_engine("hf", model=model, tokenizer=tok), tok, model


def prompt_batch(tok, questions, **columns):
    items = []
    for i, q in enumerate(questions):
        chat = [{"role": "user", "content": q}]
        ids = tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False)["input_ids"]
        items.append({"input_ids": torch.tensor(ids), "attention_mask": torch.ones(len(ids), dtype=torch.long),
                      "raw_prompt": chat, "data_source": "test", "reward_model": {"ground_truth": "6"},
                      **{k: v[i] for k, v in columns.items()}})
    return collate_prompts(items, tok.pad_token_id)


def agent(engine, tok, name, reuse_history=True, **episode):
    config = SimpleNamespace(agent=SimpleNamespace(episode=AgentEpisodeConfig(path=HARNESSES, name=name, **episode)))
    return AgentRollout(engine, tok, config, reuse_history=reuse_history)


def seen_by(rollout, episode):
    return rollout.program.fn.__globals__["SEEN"].get(episode.key, [])


def rows_of(out, i):
    return [r for r in range(len(out)) if int(out.non_tensor_batch["agent/episode"][r]) == i]


def test_appending_harness_is_token_exact(tiny):
    engine, tok, model = tiny
    rollout = agent(engine, tok, "append")
    try:
        out = rollout.generate(prompt_batch(tok, ["2+2=", "7*3="]), SamplingParams(n=2, response_length=96))
        metrics = agent_step_metrics(out)
    finally:
        rollout.close()
    assert metrics["agent/episodes"] == 4 and metrics["agent/sequences"] == 4 and metrics["agent/calls"] == 12
    assert metrics["agent/retokenized_tokens"] == 0 and metrics["agent/failed"] == 0
    assert all(metrics[f"agent/splits/{r}"] == 0 for r in ("branch", "reply_rewritten", "history_rewritten"))
    assert metrics["agent/reused_prompts"] == 8 and metrics["agent/rendered_prompts"] == 4  # the first calls
    assert len(out) == 4 and list(out.non_tensor_batch["uid"][:2]) == [out.non_tensor_batch["uid"][0]] * 2
    for i, episode in enumerate(rollout.last_episodes):
        seen = seen_by(rollout, episode)
        assert len(seen) == 3
        (r,) = rows_of(out, i)
        mask = out["response_mask"][r].bool()
        # the sampled ids, in order, exactly where the mask is 1; their log-probs the replies'
        assert out["responses"][r][mask].tolist() == [t for s in seen for t in s["token_ids"]]
        assert out["rollout_log_probs"][r][mask].tolist() == pytest.approx(
            [x for s in seen for x in s["log_probs"]], abs=1e-6)
        # the row's prompt is the first call's prompt; prompt + response up to the last sampled id is the
        # last call's prompt and reply: the sequence the model saw, token for token
        prompt = out["prompts"][r][out["attention_mask"][r, :out["prompts"].shape[1]].bool()].tolist()
        assert prompt == seen[0]["prompt_ids"]
        filled = out["attention_mask"][r, out["prompts"].shape[1]:].bool()
        assert prompt + out["responses"][r][filled].tolist() == seen[-1]["prompt_ids"] + seen[-1]["token_ids"]
        # a later call's prompt extends the earlier context (client-side view)
        for a, b in zip(seen, seen[1:]):
            assert b["prompt_ids"][:len(a["prompt_ids"]) + len(a["token_ids"])] == a["prompt_ids"] + a["token_ids"]
        # between the replies: the tokens the policy did not sample, mask 0
        assert int(mask.sum()) < int(filled.sum())
    # the trainer's own log-probs of the sampled tokens equal the engine's (temperature 1)
    lps, _ = compute_response_logprobs(model, out, 8, 1.0, False)
    mask = out["response_mask"].bool()
    assert lps[mask].tolist() == pytest.approx(out["rollout_log_probs"][mask].tolist(), abs=1e-4)
    scores, _ = agent_scores(out)
    assert scores.sum(-1).tolist() == pytest.approx(list(out.non_tensor_batch["agent/reward"]))


def test_rewritten_history_splits_and_is_counted(tiny):
    engine, tok, _ = tiny
    rollout = agent(engine, tok, "rewrite")
    try:
        out = rollout.generate(prompt_batch(tok, ["2+2=", "7*3="]), SamplingParams(n=2, response_length=96))
        metrics = agent_step_metrics(out)
    finally:
        rollout.close()
    # an episode whose first reply had text had it dropped: its third call does not extend the second's context
    rewritten = [e for e in rollout.last_episodes if seen_by(rollout, e)[0]["content"].strip()]
    assert len(rewritten) >= 3  # the random model writes something on most first turns
    assert metrics["agent/splits/history_rewritten"] == len(rewritten)
    assert metrics["agent/splits/reply_rewritten"] == metrics["agent/splits/branch"] == 0
    assert metrics["agent/sequences"] == 4 + len(rewritten)
    retokenized = 0
    for i, episode in enumerate(rollout.last_episodes):
        seen = seen_by(rollout, episode)
        rows = rows_of(out, i)
        assert len(rows) == (2 if episode in rewritten else 1)
        sampled = [t for r in rows for t in out["responses"][r][out["response_mask"][r].bool()].tolist()]
        assert sampled == [t for s in seen for t in s["token_ids"]]  # still every sampled id, once
        if episode in rewritten:  # the second row's prompt is the third call's whole prompt
            second = out["prompts"][rows[1]][out["attention_mask"][rows[1], :out["prompts"].shape[1]].bool()]
            assert second.tolist() == seen[2]["prompt_ids"]
            context = seen[1]["prompt_ids"] + seen[1]["token_ids"]
            common = next(k for k, (a, b) in enumerate(zip(context + [-1], seen[2]["prompt_ids"] + [-2])) if a != b)
            retokenized += len(context) - common
    assert metrics["agent/retokenized_tokens"] == retokenized > 0
    # every row of an episode carries its reward (a GRPO group: the episodes of a row)
    for i, o in enumerate(rollout.last_outcomes):
        assert {out.non_tensor_batch["agent/reward"][r] for r in rows_of(out, i)} == {o.reward}


def test_without_history_kept_as_tokens_a_lossy_round_trip_retokenizes(tiny):
    """Negative control of the token reuse: the same appending harness with every prompt rendered from text.
    The reply's text is decoded without special tokens and the random model samples some, so re-rendering
    changes tokens the model wrote; the splits say so."""
    engine, tok, _ = tiny
    torch.manual_seed(1234)  # the random model's samples: which special tokens it writes
    rollout = agent(engine, tok, "append", reuse_history=False)
    try:
        out = rollout.generate(prompt_batch(tok, ["2+2=", "7*3=", "1+5=", "9-4="]),
                               SamplingParams(n=2, response_length=96))
        metrics = agent_step_metrics(out)
    finally:
        rollout.close()
    specials = set(tok.all_special_ids) - {tok.eos_token_id}
    lossy = [e for e in rollout.last_episodes
             if any(t in specials for s in seen_by(rollout, e)[:2] for t in s["token_ids"])]
    assert metrics["agent/reused_prompts"] == 0
    if not lossy:  # episodes run concurrently: their sampling order, and so their tokens, can differ run to run
        pytest.skip("no episode sampled a special token this time: nothing lossy to count")
    assert metrics["agent/splits/reply_rewritten"] + metrics["agent/splits/history_rewritten"] >= len(lossy) > 0
    assert metrics["agent/retokenized_tokens"] > 0


def test_bad_episodes_are_counted_and_never_end_the_rollout(tiny):
    engine, tok, _ = tiny
    modes = ["ok", "raise", "hang", "block", "nan", "none", "wrong_model", "wrong_model_caught"]
    rollout = agent(engine, tok, "by_mode", timeout_s=4)
    try:
        start = time.monotonic()
        out = rollout.generate(prompt_batch(tok, modes), SamplingParams(n=1, response_length=32))
        took = time.monotonic() - start
        metrics = agent_step_metrics(out)
        requests = rollout.server.batcher.stats["requests"]
        time.sleep(max(0.0, 7.5 - took))  # the blocked episode wakes (6 s) and calls: refused, nothing decodes
        assert rollout.server.batcher.stats["requests"] == requests
    finally:
        rollout.close()
    assert took < 30
    failures = {c: metrics[f"agent/failures/{c}"] for c in ("raised", "timeout", "not_a_number", "wrong_model",
                                                              "exit_nonzero")}
    assert failures == {"raised": 1, "timeout": 2, "not_a_number": 2, "wrong_model": 1, "exit_nonzero": 0}
    assert metrics["agent/failed"] == 6 and metrics["agent/refused_requests/model_not_found"] == 2
    causes = [o.failure for o in rollout.last_outcomes]
    assert causes == [None, "raised", "timeout", "timeout", "not_a_number", "not_a_number", "wrong_model", None]
    for i, cause in enumerate(causes):
        for r in rows_of(out, i):
            assert out.non_tensor_batch["agent/failed"][r] == float(cause is not None)
            assert bool(out["response_mask"][r].any()) == (cause is None and modes[i] == "ok")
            assert out.non_tensor_batch["agent/reward"][r] == (0.0 if cause else 1.0)


def test_a_program_run_per_episode(tiny, tmp_path):
    engine, tok, _ = tiny
    program = tmp_path / "program.py"
    program.write_text(
        "import json, os\nfrom openai import OpenAI\n"
        "row = json.loads(os.environ['POSTTRAIN_ROW'])\n"
        "client = OpenAI(max_retries=0)\n"
        "r = client.chat.completions.create(model=os.environ['OPENAI_MODEL'], messages=row['prompt'], max_tokens=5)\n"
        "print('log line')\nprint(len(r.choices[0].message.content) + 0.5)\n")
    questions = ["2+2=", "7*3="]
    for command, failure in ((f"python {program}", None), ("exit 3", "exit_nonzero"), ("echo hello", "not_a_number")):
        config = SimpleNamespace(agent=SimpleNamespace(episode=AgentEpisodeConfig(command=command, timeout_s=60)))
        rollout = AgentRollout(engine, tok, config)
        try:
            out = rollout.generate(prompt_batch(tok, questions), SamplingParams(n=1, response_length=32))
            metrics = agent_step_metrics(out)
        finally:
            rollout.close()
        assert [o.failure for o in rollout.last_outcomes] == [failure] * 2, rollout.last_outcomes
        if failure is None:
            assert metrics["agent/calls"] == 2 and metrics["agent/failed"] == 0
            for o, r in zip(rollout.last_outcomes, range(2)):
                text = tok.decode(out["responses"][r][out["response_mask"][r].bool()].tolist(), skip_special_tokens=True)
                assert o.reward == len(text) + 0.5
        else:
            assert metrics[f"agent/failures/{failure}"] == 2
