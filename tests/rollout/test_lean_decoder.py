"""The lean decoder against the model's own forward: logits step by step (float64 and fp32), whole
generations through the hf engine (greedy and sampled, left padding, rows ending early, bf16
autocast), the architectures it declines, and rollout.lean_decode=False turning it off."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from helpers.tiny_models import tiny_llama, tiny_prompt_batch
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.config.actor_rollout_ref import RolloutConfig
from posttrain.rollout import SamplingParams, get_rollout_engine
from posttrain.rollout.hf import HFRolloutEngine
from posttrain.rollout import lean_decoder
from posttrain.rollout.lean_decoder import (
    lean_decoder_for, mkl_packing_available, onednn_bf16_packing_available, onednn_fp32_packing_available,
)

FP32_BACKENDS = ["plain"] + ["mkl"] * mkl_packing_available() + ["onednn"] * onednn_fp32_packing_available()
PROMPTS = ["1+1=", "hello there 2*3=", "x", "abc 12"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _common(tok) -> dict:
    return dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256,
                pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)


def _model(kind: str, tok, tied: bool = True):
    torch.manual_seed(3)
    if kind == "llama":  # grouped-query heads, a non-default rope base
        return tiny_llama(tok, num_key_value_heads=2, rope_theta=500.0)
    if kind == "qwen2":  # q/k/v biases, tied embeddings (untied where a test needs EOS to be emitted)
        model = Qwen2ForCausalLM(Qwen2Config(**_common(tok), tie_word_embeddings=tied))
        with torch.no_grad():  # random biases (initialized to zero), so that a dropped bias shows
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
        return model
    return MistralForCausalLM(MistralConfig(**_common(tok), sliding_window=None))


def _prefill(model, prompts):
    ids, mask, pos = prompts["input_ids"], prompts["attention_mask"], prompts["position_ids"]
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, cache=DynamicCache())
    return out.logits[:, -1], out.cache if getattr(out, "cache", None) is not None else out.past_key_values


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@torch.no_grad()
def test_step_logits_equal_the_model_forward_in_float64(kind, tok):
    """Six decoding steps of left-padded prompts: the lean step's logits against the model's
    forward on the same cache contents, in float64 (so any difference is a wrong formula)."""
    model = _model(kind, tok).double().eval()
    prompts = tiny_prompt_batch(tok, PROMPTS)
    logits, cache = _prefill(model, prompts)
    lean = lean_decoder_for(model, cache)
    assert lean is not None, f"{kind} should be decoded by the lean decoder"
    lean.load_cache(copy.deepcopy(cache), new_tokens=2)  # smaller than the steps: the buffers must grow
    mask, pos = prompts["attention_mask"], prompts["position_ids"][:, -1:]
    for _ in range(6):
        token = logits.argmax(-1, keepdim=True)
        mask, pos = torch.cat([mask, torch.ones_like(mask[:, :1])], 1), pos + 1
        out = model(input_ids=token, attention_mask=mask, position_ids=pos, use_cache=True, cache=cache)
        logits = out.logits[:, -1]
        lean_logits = lean.step(token, mask, pos)
        assert lean_logits.dtype == torch.float64
        assert (lean_logits - logits).abs().max().item() < 1e-10


@torch.no_grad()
def test_load_cache_moves_the_prefilled_cache(tok):
    """The prefilled cache moves into the decoder (no copy) and is left empty."""
    model = _model("llama", tok).eval()
    logits, cache = _prefill(model, tiny_prompt_batch(tok, PROMPTS))
    want = [(layer.keys, layer.values) for layer in cache.layers]
    lean = lean_decoder_for(model, cache)
    lean.load_cache(cache, new_tokens=3, samples=2)
    assert all(layer.keys.numel() == 0 and layer.values.numel() == 0 for layer in cache.layers)
    for mine, (keys, values) in zip(lean.layers, want):
        assert mine.prompt_keys is keys and mine.prompt_values is values
        assert mine.keys.shape == (2 * keys.shape[0], keys.shape[1], 3, keys.shape[3])


@torch.no_grad()
def test_rows_leaving_keep_the_cache_buffers(tok):
    """select() moves the kept rows (any order) to the front of the same buffers: the same contents
    as indexing, no new cache allocated (new ones at every row change fragmented the heap)."""
    model = _model("llama", tok).eval()
    cache = _prefill(model, tiny_prompt_batch(tok, PROMPTS))[1]
    lean = lean_decoder_for(model, cache)
    lean.load_cache(cache, new_tokens=3, samples=2)
    for layer in lean.layers:
        layer.keys.normal_(), layer.values.normal_()
    rows = torch.tensor([5, 0, 3, 2])
    want = [(layer.keys[rows].clone(), layer.values[rows].clone()) for layer in lean.layers]
    storage = [(layer.keys.untyped_storage().data_ptr(), layer.values.untyped_storage().data_ptr()) for layer in lean.layers]
    lean.select(rows)
    for layer, (keys, values), ptrs in zip(lean.layers, want, storage):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        assert (layer.keys.untyped_storage().data_ptr(), layer.values.untyped_storage().data_ptr()) == ptrs
    assert torch.equal(lean.slot, rows)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@torch.no_grad()
def test_samples_share_their_prompt_cache_in_float64(kind, tok):
    """Three samples per prompt decoding from one copy of its cache, rows leaving after the second
    and fourth steps: logits equal to the model's forward on the cache repeated for every row."""
    model = _model(kind, tok).double().eval()
    prompts = tiny_prompt_batch(tok, PROMPTS)
    logits, cache = _prefill(model, prompts)
    lean = lean_decoder_for(model, cache)
    lean.load_cache(copy.deepcopy(cache), new_tokens=3, samples=3)
    cache.batch_repeat_interleave(3)
    logits = logits.repeat_interleave(3, dim=0) + torch.randn(12, logits.shape[1], dtype=torch.float64)
    mask = prompts["attention_mask"].repeat_interleave(3, dim=0)
    pos = prompts["position_ids"][:, -1:].repeat_interleave(3, dim=0)
    for step, keep in enumerate([None, None, [0, 2, 3, 5, 7, 8, 9, 11], None, [1, 2, 6, 7], None]):
        if keep is not None:
            keep = torch.tensor(keep)
            lean.select(keep)
            cache.batch_select_indices(keep)
            logits, mask, pos = logits[keep], mask[keep], pos[keep]
        token = logits.argmax(-1, keepdim=True)  # noise above: the samples of a prompt take different tokens
        mask, pos = torch.cat([mask, torch.ones_like(mask[:, :1])], 1), pos + 1
        logits = model(input_ids=token, attention_mask=mask, position_ids=pos, use_cache=True, cache=cache).logits[:, -1]
        assert (lean.step(token, mask, pos) - logits).abs().max().item() < 1e-10, f"step {step}"
        logits = logits + torch.randn(logits.shape, dtype=torch.float64)


@torch.no_grad()
def test_keys_cast_once_under_autocast_equal_casting_at_every_step(tok):
    """Under bf16 autocast the prefilled cache holds float32 keys; the decoder casts them to bf16 once.
    A decoder given float32 key buffers instead (autocast then casts them, and the float32 keys
    written each step, at every matmul) gives bit-equal logits: the same rounding, once."""
    model = _model("llama", tok).eval()
    prompts = tiny_prompt_batch(tok, PROMPTS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, cache = _prefill(model, prompts)
        assert cache.layers[0].keys.dtype == torch.float32  # rotated in float32
        once, every = (lean_decoder_for(model, copy.deepcopy(cache)) for _ in range(2))
        once.load_cache(copy.deepcopy(cache), new_tokens=4, samples=2)
        every.load_cache(copy.deepcopy(cache), new_tokens=4, samples=2)
        for layer in every.layers:
            layer.prompt_keys, layer.keys = layer.prompt_keys.float(), layer.keys.float()
        assert once.layers[0].prompt_keys.dtype == once.layers[0].keys.dtype == torch.bfloat16
        token = logits.float().argmax(-1, keepdim=True).repeat_interleave(2, dim=0)
        mask = prompts["attention_mask"].repeat_interleave(2, dim=0)
        pos = prompts["position_ids"][:, -1:].repeat_interleave(2, dim=0)
        for step in range(4):
            mask, pos = torch.cat([mask, torch.ones_like(mask[:, :1])], 1), pos + 1
            got, want = once.step(token, mask, pos), every.step(token, mask, pos)
            assert torch.equal(got, want), f"step {step}"
            token = (want.float() + torch.randn(want.shape)).argmax(-1, keepdim=True)


@torch.no_grad()
def test_step_comparison_can_fail(tok):
    """Negative control: the same comparison with one layer's attention scale doubled differs."""
    model = _model("llama", tok).double().eval()
    prompts = tiny_prompt_batch(tok, PROMPTS)
    logits, cache = _prefill(model, prompts)
    lean = lean_decoder_for(model, cache)
    lean.load_cache(copy.deepcopy(cache), new_tokens=4)
    lean.layers[1].scale *= 2
    token = logits.argmax(-1, keepdim=True)
    mask = torch.cat([prompts["attention_mask"], torch.ones_like(token)], 1)
    pos = prompts["position_ids"][:, -1:] + 1
    want = model(input_ids=token, attention_mask=mask, position_ids=pos, use_cache=True, cache=cache).logits[:, -1]
    assert (lean.step(token, mask, pos) - want).abs().max().item() > 1e-3


def _generate(model, tok, lean: bool, sampling: SamplingParams, autocast=None, eos: list[int] | None = None,
              texts: list[str] = PROMPTS):
    engine = HFRolloutEngine(model, tok, lean_decode=lean, autocast=autocast, eos_token_ids=eos)
    torch.manual_seed(11)
    return engine.generate(tiny_prompt_batch(tok, texts), sampling)


@pytest.mark.parametrize("backend", FP32_BACKENDS)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("greedy", [True, False])
def test_engine_generations_equal_with_and_without_lean_decoding(kind, greedy, backend, tok, monkeypatch):
    """fp32 through each packing this build has, n=3, rows leaving the batch at different steps (the
    stop token is the third token the model wrote in its first row): the same tokens and the same
    rollout log-probs (to 1e-5) as decoding with the model's own forward."""
    monkeypatch.setattr(lean_decoder, "fp32_matmul_backend", lambda groups: backend)
    model = _model(kind, tok)
    sampling = SamplingParams(n=3, temperature=1.0, response_length=12, do_sample=not greedy)
    stop = [int(_generate(model, tok, False, sampling)["responses"][0, 2])]
    plain, lean = _generate(model, tok, False, sampling, eos=stop), _generate(model, tok, True, sampling, eos=stop)
    lengths = plain["response_mask"].sum(-1)
    assert lengths.min() < lengths.max(), "rows should end at different steps"
    assert torch.equal(plain["responses"], lean["responses"])
    assert torch.equal(plain["response_mask"], lean["response_mask"])
    assert (plain["rollout_log_probs"] - lean["rollout_log_probs"]).abs().max().item() < 1e-5


def _greedy_margins_and_logprobs(model, out, autocast):
    """The model's own forward (under ``autocast``) over a generation: for each response token, how
    far its logit is below the position's largest, and its log-probability."""
    with torch.no_grad(), autocast():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       position_ids=out["position_ids"]).logits.float()
    width = out["responses"].shape[1]
    logits = logits[:, -width - 1:-1]
    chosen = logits.gather(-1, out["responses"][..., None])[..., 0]
    margins = (logits.max(-1).values - chosen)[out["response_mask"].bool()]
    logprobs = torch.log_softmax(logits, -1).gather(-1, out["responses"][..., None])[..., 0]
    return margins, logprobs


def test_engine_under_bf16_autocast_matches_the_model_forward(tok):
    """bf16 autocast (weights cast once instead of at every call): every greedy token is the model's
    own autocast argmax up to bf16 rounding (its logit within 0.02 of the largest, about 2 bf16
    steps; the model's own decoding passes the same check), and the rollout log-probs are within
    bf16 rounding of the model's teacher-forced ones. Negative control: the responses shifted by one
    position are far from greedy. Today the two decodings also give the same tokens (the lean
    step keeps the model's precisions), checked too."""
    model = _model("llama", tok)
    sampling = SamplingParams(n=2, response_length=10, do_sample=False)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    outs = {lean: _generate(model, tok, lean, sampling, autocast) for lean in (False, True)}
    for lean, out in outs.items():
        margins, logprobs = _greedy_margins_and_logprobs(model, out, autocast)
        assert margins.max().item() < 0.02, f"lean={lean}"
        assert (out["rollout_log_probs"] - logprobs).abs().max().item() < 1e-2, f"lean={lean}"
    assert torch.equal(outs[False]["responses"], outs[True]["responses"])
    out = outs[True]
    out["responses"] = out["responses"].roll(1, dims=1)
    assert _greedy_margins_and_logprobs(model, out, autocast)[0].max().item() > 0.1


def test_declines_what_it_does_not_reproduce(tok):
    """Sliding-window Mistral, a LoRA-wrapped projection, an unknown architecture and a model off the
    CPU keep the model's forward."""
    prompts = tiny_prompt_batch(tok, PROMPTS[:2])
    windowed = MistralForCausalLM(MistralConfig(**_common(tok), sliding_window=4)).eval()
    assert lean_decoder_for(windowed, _prefill(windowed, prompts)[1]) is None

    wrapped = _model("llama", tok).eval()
    layer = wrapped.model.layers[0].mlp

    class Wrapped(torch.nn.Module):  # e.g. peft's lora.Linear: not an nn.Linear
        def __init__(self, inner):
            super().__init__()
            self.inner, self.weight = inner, inner.weight

        def forward(self, x):
            return self.inner(x)

    layer.up_proj = Wrapped(layer.up_proj)
    with torch.no_grad():
        assert lean_decoder_for(wrapped, _prefill(wrapped, prompts)[1]) is None

    other = _model("llama", tok).eval()
    other.config.model_type = "some_other_arch"
    with torch.no_grad():
        assert lean_decoder_for(other, _prefill(other, prompts)[1]) is None

    elsewhere = _model("llama", tok).eval()  # off the CPU (a GPU in real use; the meta device here)
    with torch.no_grad():
        cache = _prefill(elsewhere, prompts)[1]
        assert lean_decoder_for(elsewhere, cache) is not None
        assert lean_decoder_for(elsewhere.to("meta"), cache) is None


def test_a_trained_bf16_actor_with_recast_linears_is_decoded_lean(tok):
    """The one-process placement turns a trained bf16 role's linears into RecastLinear (the same function):
    its rollout keeps the lean decoder (an exact-type check had sent it to the model's forward, 1.5x slower)."""
    from posttrain.models.lean.backward import RecastLinear, keep_less_for_backward

    prompts = tiny_prompt_batch(tok, PROMPTS[:2])
    model = _model("llama", tok).eval()
    keep_less_for_backward(model)
    assert isinstance(model.model.layers[0].mlp.up_proj, RecastLinear)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert lean_decoder_for(model, _prefill(model, prompts)[1]) is not None


def test_rollout_lean_decode_key_turns_it_off(tok):
    model = _model("llama", tok)
    on = get_rollout_engine("hf", model=model, tokenizer=tok, config=RolloutConfig(enforce_eager=True))
    off = get_rollout_engine("hf", model=model, tokenizer=tok, config=RolloutConfig(lean_decode=False))
    assert on.lean_decode is True and off.lean_decode is False


@pytest.mark.skipif(not mkl_packing_available(), reason="this torch build has no MKL packed GEMM")
def test_packed_weight_equals_linear_as_rows_leave():
    """fp32 through MKL's packed GEMM, two projections fused: packed for 16 rows, then 9 (padded to
    16), 6 (packed again), 5 (padded to 6), then 2 and 1 (below PACK_MIN_ROWS: the model's weights,
    the packed copy dropped); and 5 rows when too few steps remain to repay packing (the model's
    weights). Every result equals the two layers' outputs."""
    from posttrain.rollout.lean_decoder import PACK_MIN_ROWS, _Weight

    torch.manual_seed(0)
    first, second = torch.nn.Linear(64, 96), torch.nn.Linear(64, 32)  # fused, as q/k/v are
    packed = _Weight([first, second], torch.float32)
    assert packed.weight is None  # no fused copy kept: the packed weight is the only copy
    assert PACK_MIN_ROWS == 4
    for rows, may_pack, packed_for in ((16, True, 16), (9, True, 16), (6, True, 6), (5, False, 6), (2, True, 0),
                                       (1, True, 0)):
        x = torch.randn(rows, 64)
        out = packed(x, may_pack)
        assert packed.rows == packed_for and (packed.packed is None) == (packed_for == 0)
        want = torch.cat([first(x), second(x)], dim=-1)
        assert (out - want).abs().max().item() < 1e-5
    late = _Weight([first, second], torch.float32)
    late(torch.randn(16, 64))
    x = torch.randn(5, 64)
    out = late(x, may_pack=False)  # fewer than half the rows and few steps left: no new packing
    assert late.rows == 0 and late.packed is None
    assert (out - torch.cat([first(x), second(x)], dim=-1)).abs().max().item() < 1e-5


@pytest.mark.skipif(not onednn_bf16_packing_available(), reason="no oneDNN bf16 packing on this CPU/build")
def test_onednn_packed_bf16_weight_equals_linear_at_every_row_count():
    """bf16: the fused copy packed once for oneDNN (no bf16 copy kept) gives F.linear's result on
    the fused bf16 weight and bias bit for bit, at every row count (rows leaving need no re-packing)."""
    from posttrain.rollout.lean_decoder import _Weight

    torch.manual_seed(0)
    first, second = torch.nn.Linear(64, 96), torch.nn.Linear(64, 32)
    packed = _Weight([first, second], torch.bfloat16)
    assert packed.onednn is not None and packed.weight is None
    weight = torch.cat([first.weight, second.weight]).detach().bfloat16()
    bias = torch.cat([first.bias, second.bias]).detach().bfloat16()
    for rows in (16, 9, 3, 1):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(packed(x), torch.nn.functional.linear(x, weight, bias)), rows


@pytest.mark.skipif(not onednn_fp32_packing_available(), reason="no oneDNN fp32 packing in this build")
def test_onednn_packed_fp32_weight_equals_linear_at_every_row_count():
    """fp32 packed once for oneDNN (no fused copy kept): F.linear's result up to fp32 rounding at
    every row count, with no re-packing as rows leave; a wrong bias shows (negative control)."""
    from posttrain.rollout.lean_decoder import _Weight

    torch.manual_seed(0)
    first, second = torch.nn.Linear(64, 96), torch.nn.Linear(64, 32)
    packed = _Weight([first, second], torch.float32, backend="onednn")
    assert packed.onednn is not None and packed.weight is None and packed.packed is None
    for rows in (16, 9, 3, 1):
        x = torch.randn(rows, 64)
        want = torch.cat([first(x), second(x)], dim=-1)
        assert (packed(x) - want).abs().max().item() < 1e-5, rows
        assert packed.packed is None  # oneDNN's one packing serves every row count
    packed.bias = packed.bias + 1e-3
    assert (packed(x) - want).abs().max().item() > 5e-4


def test_fp32_backend_is_timed_once_per_shape_and_thread_count(monkeypatch, tmp_path):
    """The first decoder on a machine times the packings; later ones with the same shapes and threads
    reuse the answer, which is one of the backends this build has."""
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path))
    calls = []
    real = lean_decoder._time_fp32_backends
    monkeypatch.setattr(lean_decoder, "_FP32_BACKENDS", {})
    monkeypatch.setattr(lean_decoder, "_time_fp32_backends", lambda weights: calls.append(1) or real(weights))
    groups = [[torch.nn.Linear(64, 64), torch.nn.Linear(64, 32)], [torch.nn.Linear(96, 64)]]
    first = lean_decoder.fp32_matmul_backend(groups)
    assert first in FP32_BACKENDS
    same_shapes = [[torch.nn.Linear(64, 96)], [torch.nn.Linear(96, 64)]]  # 64 + 32 outputs fused = 96
    assert lean_decoder.fp32_matmul_backend(same_shapes) == first and len(calls) == 1
    lean_decoder.fp32_matmul_backend([[torch.nn.Linear(64, 32)]])
    assert len(calls) == 2


def test_fp32_backend_answer_is_kept_for_later_processes(monkeypatch, tmp_path):
    """A later process (an empty in-process table) reads the machine's cached answer instead of timing,
    so every run on a machine rounds the same way; an answer this build cannot run is timed again."""
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path))
    calls = []
    real = lean_decoder._time_fp32_backends
    monkeypatch.setattr(lean_decoder, "_time_fp32_backends", lambda weights: calls.append(1) or real(weights))
    groups = [[torch.nn.Linear(48, 80)]]
    monkeypatch.setattr(lean_decoder, "_FP32_BACKENDS", {})
    first = lean_decoder.fp32_matmul_backend(groups)
    path = tmp_path / "fp32_matmul.json"
    (key, cached), = json.loads(path.read_text()).items()
    assert cached == first and len(calls) == 1
    path.write_text(json.dumps({key: "plain"}))  # a machine whose timing chose the plain GEMM
    monkeypatch.setattr(lean_decoder, "_FP32_BACKENDS", {})
    assert lean_decoder.fp32_matmul_backend(groups) == "plain" and len(calls) == 1  # read, not timed
    path.write_text(json.dumps({key: "no-such-kernel"}))
    monkeypatch.setattr(lean_decoder, "_FP32_BACKENDS", {})
    assert lean_decoder.fp32_matmul_backend(groups) in FP32_BACKENDS and len(calls) == 2


def test_fp32_backend_prefers_onednn_within_five_percent():
    """oneDNN's packing needs no re-packing as rows leave, so it wins near-ties; a clearly faster
    product wins otherwise."""
    fastest = lean_decoder._fastest_fp32_backend
    assert fastest({"plain": 1.0, "mkl": 1.01, "onednn": 1.04}) == "onednn"
    assert fastest({"plain": 1.0, "mkl": 0.9, "onednn": 1.2}) == "mkl"
    assert fastest({"plain": 1.0, "onednn": 1.2}) == "plain"
    assert fastest({"plain": 1.0, "mkl": 0.8}) == "mkl"


SHARED = "You are a calculator. Example: 31 + 45 = 76. Now: "  # more than SHARED_PREFIX_MIN_TOKENS tokens


@pytest.mark.parametrize("lean", [True, False])
def test_shared_prompt_beginning_prefilled_once_equals_a_plain_prefill(lean, tok, monkeypatch):
    """Prompts that begin alike (different lengths after it, left-padded): prefilling the shared
    tokens once, then each prompt's own, gives the plain prefill's generation in float64 (same greedy
    tokens, log-probs to 1e-10), through the lean decoder (which keeps the shared positions once)
    and the model's own step. Negative control:
    a shared part taken one token too long (the first prompt's token for all) changes the log-probs."""
    from posttrain.rollout import hf

    model = _model("llama", tok).double()
    texts = [SHARED + "1+1=", SHARED + "hello there 2*3=", SHARED + "abc 12"]
    prompts = tiny_prompt_batch(tok, texts)
    ids, mask, pos = prompts["input_ids"], prompts["attention_mask"], prompts["position_ids"]
    shared = hf._shared_prefix_length(ids, mask, pos)
    assert shared >= hf.SHARED_PREFIX_MIN_TOKENS and shared == len(tok(SHARED, add_special_tokens=False)["input_ids"])
    sampling = SamplingParams(n=2, response_length=8, do_sample=False)
    seen, kept_once = [], []
    real, load = hf._shared_prefix_length, lean_decoder.LeanDecoder.load_cache
    monkeypatch.setattr(hf, "_shared_prefix_length", lambda *a: seen.append(real(*a)) or seen[-1])
    monkeypatch.setattr(lean_decoder.LeanDecoder, "load_cache",
                        lambda self, *a: kept_once.append(a[3]) or load(self, *a))
    once = _generate(model, tok, lean, sampling, texts=texts)
    monkeypatch.setattr(hf, "_shared_prefix_length", lambda *a: 0)
    plain = _generate(model, tok, lean, sampling, texts=texts)
    assert seen == [shared]
    assert kept_once == ([shared, 0] if lean else [])  # the lean decoder kept the shared positions once
    assert torch.equal(once["responses"], plain["responses"])
    assert (once["rollout_log_probs"] - plain["rollout_log_probs"]).abs().max().item() < 1e-10
    monkeypatch.setattr(hf, "_shared_prefix_length", lambda *a: real(*a) + 1)
    wrong = _generate(model, tok, lean, sampling, texts=texts)
    assert (wrong["rollout_log_probs"] - plain["rollout_log_probs"]).abs().max().item() > 1e-6


def test_shared_prefix_length_rules():
    """Left-padded rows only; each row keeps one token of its own; positions must agree too."""
    from posttrain.rollout.hf import _shared_prefix_length

    ids = torch.tensor([[0, 5, 6, 7, 8], [5, 6, 7, 9, 9], [0, 0, 5, 6, 1]])
    mask = (ids != 0).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    assert _shared_prefix_length(ids, mask, pos) == 2
    assert _shared_prefix_length(ids[:2], mask[:2], pos[:2]) == 3
    assert _shared_prefix_length(ids[:1], mask[:1], pos[:1]) == 0
    assert _shared_prefix_length(ids[:2], mask[:2], pos[:2] + torch.tensor([[0], [1]])) == 0
    right_padded = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]])
    assert _shared_prefix_length(right_padded, (right_padded != 0).long(), pos[:2, :4]) == 0
