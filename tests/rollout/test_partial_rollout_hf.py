"""Partial rollouts on the hf engine (verl's ``async_training.partial_rollout``): new weights loaded between two
decoding steps take over the rest of each response. Checked against a plain reference that runs the whole
sequence through the model for every token (no cache): tokens ``< k`` come from the old weights, tokens
``>= k`` from the new ones, and each token's rollout log-prob is the one of the weights that sampled it."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_models import tiny_llama, tiny_prompt_batch
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.hf import HFRolloutEngine

PROMPTS = ["1+1=", "hello there 2*3=", "x"]
R, K = 12, 4  # response length; the new weights arrive after the K-th token


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _model(tok, seed):
    model = tiny_llama(tok, seed=seed)
    with torch.no_grad():  # EOS often, so rows leave the decoding batch at different steps
        model.lm_head.weight[tok.eos_token_id] = model.lm_head.weight[tok.eos_token_id] * 3 + 0.02
    return model.eval()


def _engine_with_push_after(tok, k, lean_decode):
    """An engine on the old weights whose pause point loads the new ones at its k-th call (after k tokens)."""
    model, new = _model(tok, 0), _model(tok, 1)
    engine = HFRolloutEngine(model, tok, lean_decode=lean_decode)
    calls = []

    def pause_point() -> bool:
        calls.append(1)
        if len(calls) != k:
            return False
        model.load_state_dict(new.state_dict())
        return True

    engine.pause_point = pause_point
    return engine, _model(tok, 0), new, calls


@torch.no_grad()
def _reference_log_probs(models, prompt_ids, response, k):
    """Log-probs of ``response`` after ``prompt_ids`` (no padding): token ``t`` under ``models[t >= k]``."""
    out = []
    for t, token in enumerate(response.tolist()):
        ids = torch.cat([prompt_ids, response[:t]])[None]
        logits = models[int(t >= k)](input_ids=ids).logits[0, -1].float()
        out.append(torch.log_softmax(logits, -1)[token])
    return torch.stack(out)


def _rows(batch, tok, prompts, n):
    """Per output row: (prompt tokens without padding, response tokens up to and with EOS, its log-probs)."""
    for i in range(len(batch)):
        mask = batch["response_mask"][i].bool()
        prompt = tok(prompts[i // n], add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        yield prompt, batch["responses"][i][mask], batch["rollout_log_probs"][i][mask]


@pytest.mark.parametrize("lean_decode", [False, True])
def test_sampled_tokens_carry_the_log_probs_of_the_weights_that_sampled_them(tok, lean_decode):
    engine, old, new, calls = _engine_with_push_after(tok, K, lean_decode)
    torch.manual_seed(0)
    batch = engine.generate(tiny_prompt_batch(tok, PROMPTS), SamplingParams(n=3, temperature=1.0, response_length=R))
    assert len(calls) >= K
    lengths = batch["response_mask"].sum(1)
    assert lengths.min() < lengths.max() and lengths.max() > K  # rows left early; some ran past the push
    checked_after = 0
    for prompt, response, got in _rows(batch, tok, PROMPTS, 3):
        want = _reference_log_probs((old, new), prompt, response, K)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        if len(response) > K:  # negative control: the old weights alone would give other log-probs there
            stale = _reference_log_probs((old, old), prompt, response, K)
            assert (got[K:] - stale[K:]).abs().max() > 1e-2
            checked_after += 1
    assert checked_after > 0


@pytest.mark.parametrize("lean_decode", [False, True])
def test_greedy_tokens_equal_a_plain_loop_that_switches_weights(tok, lean_decode):
    engine, old, new, _ = _engine_with_push_after(tok, K, lean_decode)
    greedy = SamplingParams(n=1, do_sample=False, response_length=R)
    batch = engine.generate(tiny_prompt_batch(tok, PROMPTS), greedy)
    for i, text in enumerate(PROMPTS):
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        want = []
        with torch.no_grad():
            for t in range(R):
                logits = (old if t < K else new)(input_ids=torch.cat([ids, torch.tensor(want, dtype=torch.long)])[None]).logits
                want.append(int(logits[0, -1].argmax()))
                if want[-1] == tok.eos_token_id:
                    break
        got = batch["responses"][i][batch["response_mask"][i].bool()].tolist()
        assert got == want, (i, got, want)


def test_no_pause_point_is_the_plain_generation(tok):
    """Without a push the pause point costs nothing: the same samples as an engine without one."""
    engine, _, _, calls = _engine_with_push_after(tok, 10**6, lean_decode=True)
    plain = HFRolloutEngine(_model(tok, 0), tok)
    sampling = SamplingParams(n=2, temperature=1.0, response_length=R)
    torch.manual_seed(5)
    got = engine.generate(tiny_prompt_batch(tok, PROMPTS), sampling)
    torch.manual_seed(5)
    want = plain.generate(tiny_prompt_batch(tok, PROMPTS), sampling)
    assert calls and torch.equal(got["responses"], want["responses"])
    assert torch.equal(got["rollout_log_probs"], want["rollout_log_probs"])
