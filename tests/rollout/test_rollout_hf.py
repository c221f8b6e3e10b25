"""The hf rollout engine on a tiny random Llama: output layout, EOS masking, sampling params, errors."""

from __future__ import annotations


import pytest
import torch

from posttrain.config.actor_rollout_ref import RolloutConfig, SamplingConfig
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.rollout import SamplingParams, get_rollout_engine
from posttrain.rollout.hf import HFRolloutEngine, response_mask_from_eos
from helpers.tiny_models import tiny_llama, tiny_prompt_batch

PROMPTS = ["1+1=", "hello there 2*3=", "x"]
R = 10


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def eos_heavy_engine(tok):
    """An engine whose model emits EOS often (lm_head row of EOS scaled up), so masks vary."""
    model = tiny_llama(tok)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] = model.lm_head.weight[tok.eos_token_id] * 4 + 0.02
    return HFRolloutEngine(model, tok)


def test_response_mask_from_eos_hand_case():
    eos = 5
    responses = torch.tensor([[1, 2, 5, 0, 0], [1, 5, 5, 5, 5], [1, 2, 3, 4, 6]])
    # up to and including the first EOS; the third row never stops
    want = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(response_mask_from_eos(responses, [eos], 5), want)
    assert torch.equal(response_mask_from_eos(responses, [eos], 3)[2], torch.tensor([1, 1, 1, 0, 0]))


def test_generate_layout_and_eos(tok, eos_heavy_engine):
    prompts = tiny_prompt_batch(tok, PROMPTS, uids=["a", "b", "c"])
    torch.manual_seed(0)
    out = eos_heavy_engine.generate(prompts, SamplingParams(n=4, temperature=1.0, response_length=R))
    n_rows, plen = 12, prompts["input_ids"].shape[1]
    assert list(out["uid"]) == ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    assert out["responses"].shape == (n_rows, R) and out["input_ids"].shape == (n_rows, plen + R)
    assert torch.equal(out["prompts"], prompts["input_ids"].repeat_interleave(4, 0))
    assert torch.equal(out["input_ids"][:, plen:], out["responses"])
    mask = out["response_mask"]
    assert torch.equal(out["attention_mask"][:, plen:], mask)
    lengths = mask.sum(-1)
    assert lengths.min() < R, "the EOS-heavy model should stop some responses early"
    for row, mask_row, length in zip(out["responses"], mask, lengths):
        assert torch.equal(mask_row, (torch.arange(R) < length).long())  # mask is a prefix
        if length < R:
            assert row[length - 1] == tok.eos_token_id  # ends with (and includes) EOS
            assert torch.all(row[length:] == tok.pad_token_id)
        assert (row[: max(int(length) - 1, 0)] == tok.eos_token_id).sum() == 0
    pos = out["position_ids"]
    assert torch.equal(pos[:, plen:], pos[:, plen - 1:plen] + torch.arange(1, R + 1))
    lp = out["rollout_log_probs"]
    assert torch.all(lp[mask.bool()] < 0) and torch.all(lp[~mask.bool()] == 0)


def test_greedy_validation_is_deterministic_and_single(tok):
    engine = HFRolloutEngine(tiny_llama(tok), tok)
    cfg = RolloutConfig(n=5, temperature=1.0, response_length=R, calculate_log_probs=True,
                        val_kwargs=SamplingConfig(temperature=0.0, do_sample=False, n=3))
    val = SamplingParams.from_rollout_config(cfg, validate=True)
    assert val.greedy and val.n == 1
    prompts = tiny_prompt_batch(tok, PROMPTS)
    a = engine.generate(prompts, val)
    b = engine.generate(prompts, val)
    assert len(a) == 3 and torch.equal(a["responses"], b["responses"])
    # greedy = argmax of the (temperature-1) log-probs: every chosen token is the most likely one
    logits = engine.model(input_ids=a["input_ids"], attention_mask=a["attention_mask"],
                          position_ids=a["position_ids"]).logits[:, -R - 1:-1]
    mask = a["response_mask"].bool()
    assert torch.equal(logits.argmax(-1)[mask], a["responses"][mask])


def test_sampling_params_from_config():
    cfg = RolloutConfig(n=4, temperature=0.7, top_p=0.9, top_k=50, do_sample=True, response_length=33)
    sp = SamplingParams.from_rollout_config(cfg)
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.response_length) == (4, 0.7, 0.9, 50, 33)
    assert not sp.greedy and sp.logprob_temperature == 0.7
    greedy = SamplingParams.from_rollout_config(RolloutConfig(temperature=0.0, response_length=4))
    assert greedy.greedy and greedy.logprob_temperature == 1.0


def test_update_weights_shared_and_copied(tok):
    model = tiny_llama(tok)
    engine = HFRolloutEngine(model, tok)
    engine.update_weights(model)  # hybrid engine: same module, nothing to do
    other = tiny_llama(tok, seed=7)
    engine.update_weights(other.state_dict())
    assert torch.equal(engine.model.lm_head.weight, other.lm_head.weight)


def test_uids_assigned_when_missing(tok):
    engine = HFRolloutEngine(tiny_llama(tok), tok)
    prompts = tiny_prompt_batch(tok, PROMPTS)
    prompts.non_tensor_batch.pop("uid")
    out = engine.generate(prompts, SamplingParams(n=2, response_length=3, calculate_log_probs=False))
    uids = list(out["uid"])
    assert uids[0] == uids[1] != uids[2] == uids[3] and "rollout_log_probs" not in out


def test_unknown_and_unbuilt_engines_say_what_to_do():
    with pytest.raises(NotImplementedError, match="rollout.name=vllm or hf"):
        get_rollout_engine("sglang")
    with pytest.raises(ValueError, match="valid"):
        get_rollout_engine("nope")
