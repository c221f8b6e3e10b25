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


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def test_sampling_draws_from_the_truncated_softmax():
    """Token frequencies over 40000 draws against the distribution worked out by hand: top-k 4 keeps
    the four likeliest, top-p 0.8 then cuts the least likely of those (HF's rule: ascending cumulative
    mass <= 1 - top_p is removed), temperature 0.5 squares the probabilities before both cuts."""
    from posttrain.rollout.hf import _sample

    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.04, 0.01], dtype=torch.float64)
    rows = 40000
    logits = (probs.log() * 0.5).float().expand(rows, -1)  # / temperature 0.5 gives back log(probs)
    sampling = SamplingParams(n=1, temperature=0.5, top_k=4, top_p=0.8, response_length=1)
    torch.manual_seed(0)
    token, lp = _sample(logits, sampling, want_log_probs=True)
    kept = torch.tensor([0.4, 0.3, 0.15, 0, 0, 0], dtype=torch.float64)  # 0.1/0.95 = 0.105 <= 0.2: cut
    want = kept / kept.sum()
    got = _frequencies(token, 6)
    sigma = (want * (1 - want) / rows).sqrt()
    assert (got - want).abs().max() < 5 * sigma.max() and got[3:].sum() == 0
    untruncated = probs / probs.sum()  # the control: the test tells the two distributions apart
    assert (got - untruncated).abs().max() > 20 * sigma.max()
    # the reported log-prob: log_softmax(logits / T) at the token, with no truncation
    assert torch.allclose(lp.double(), probs.log()[token], atol=1e-6)


def test_sampling_without_truncation_and_greedy():
    from posttrain.rollout.hf import _sample

    probs = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    logits = probs.log().float().expand(40000, -1)
    torch.manual_seed(1)
    token, _ = _sample(logits, SamplingParams(n=1, temperature=1.0, response_length=1), want_log_probs=False)
    assert (_frequencies(token, 4) - probs).abs().max() < 5 * (0.25 / 40000) ** 0.5
    greedy, lp = _sample(logits[:2], SamplingParams(n=1, temperature=0.0, response_length=1), want_log_probs=True)
    assert greedy.tolist() == [0, 0] and torch.allclose(lp.double(), probs.log()[[0, 0]], atol=1e-6)


def test_reserved_cache_decodes_exactly_as_the_growing_one(tok, eos_heavy_engine, monkeypatch):
    """The in-place KV cache (posttrain/rollout/kv_cache.py) against transformers' concatenating one:
    same tokens and log-probs, with rows leaving the batch at EOS (the cache's rows are selected)."""
    from posttrain.rollout import hf

    prompts = tiny_prompt_batch(tok, PROMPTS, uids=["a", "b", "c"])
    sampling = SamplingParams(n=4, temperature=1.0, response_length=R)
    monkeypatch.setattr(eos_heavy_engine, "lean_decode", False)  # transformers' cache both times
    reserved = []
    original = hf._ModelStepper.reserve
    monkeypatch.setattr(hf._ModelStepper, "reserve", lambda self, n: reserved.append(original(self, n)) or reserved[-1])
    torch.manual_seed(3)
    fast = eos_heavy_engine.generate(prompts, sampling)
    monkeypatch.setattr(hf._ModelStepper, "reserve", lambda self, n: False)
    torch.manual_seed(3)
    plain = eos_heavy_engine.generate(prompts, sampling)
    assert reserved == [True]
    lengths = fast["response_mask"].sum(1)
    assert lengths.min() < lengths.max()  # some rows ended early and left the cache
    assert torch.equal(fast["responses"], plain["responses"])
    assert torch.equal(fast["rollout_log_probs"], plain["rollout_log_probs"])


def test_reserved_layer_grows_past_its_room():
    from posttrain.rollout.kv_cache import ReservedLayer

    keys, values = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    layer = ReservedLayer(keys, values, capacity=5)
    steps = [(torch.randn(2, 3, 1, 5), torch.randn(2, 3, 1, 5)) for _ in range(3)]
    for k, v in steps:
        out_k, out_v = layer.update(k, v)
    assert torch.equal(out_k, torch.cat([keys] + [k for k, _ in steps], dim=2))
    assert torch.equal(out_v, torch.cat([values] + [v for _, v in steps], dim=2))
    assert layer.get_seq_length() == 7
    layer.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer.keys, out_k[1:])
