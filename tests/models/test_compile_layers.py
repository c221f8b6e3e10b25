"""compile_layers: the decoder layers through torch.compile (inductor) inside the scoring/training
forwards only. Compared with the eager model on the same weights (float32, so fusion may only
reorder roundings): log-probs, entropies and gradients; one graph per mode for every length."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from helpers.tiny_models import tiny_llama
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.config.actor_rollout_ref import ActorModelConfig
from posttrain.models import compile as compile_mod
from posttrain.models import enable_activation_checkpointing, response_logprobs
from posttrain.models.lora import apply_lora, lora_settings
from posttrain.models.compile import compiled_layers, decoder_layers, disable_layer_compile, enable_layer_compile


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _batch(tok, prompt_len: int, resp_len: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, len(tok), (3, prompt_len + resp_len), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    mask[1, prompt_len + 1:] = 0  # a short response
    pos = torch.clamp(mask.cumsum(-1) - 1, min=0)
    return ids, mask, pos, ids[:, prompt_len:]


def _logprobs_and_grads(model, batch, remove_padding=False, shared_prefix=False):
    model.zero_grad(set_to_none=True)
    lp, ent = response_logprobs(model, *batch, temperature=0.7, calculate_entropy=True, remove_padding=remove_padding,
                                shared_prefix=shared_prefix)
    (lp.sum() + 0.1 * ent.sum()).backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_compiled_layers_equal_eager_and_compile_once_per_mode(tok):
    torch._dynamo.reset()
    model = tiny_llama(tok)
    keys = list(model.state_dict())
    shapes = [(5, 4, 0), (7, 6, 1)]  # two sequence lengths: dynamic shapes, no recompilation
    want = [_logprobs_and_grads(model, _batch(tok, *s)) for s in shapes]
    with torch.no_grad():
        want_nograd = response_logprobs(model, *_batch(tok, 6, 3, 2))[0]

    enable_layer_compile(model)
    before = _graphs()
    got = [_logprobs_and_grads(model, _batch(tok, *s)) for s in shapes]
    trained = _graphs() - before
    with torch.no_grad():
        got_nograd = response_logprobs(model, *_batch(tok, 6, 3, 2))[0]
    inferred = _graphs() - before - trained

    assert trained == 1 and inferred == 1, (trained, inferred)  # negative control: eager adds none
    for (lp, ent, grads), (lp_c, ent_c, grads_c) in zip(want, got):
        torch.testing.assert_close(lp_c, lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent_c, ent, rtol=1e-5, atol=1e-5)
        for name in grads:
            torch.testing.assert_close(grads_c[name], grads[name], rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(got_nograd, want_nograd, rtol=1e-5, atol=1e-5)

    # outside the scoring forward the model is the original one: generation never compiles
    assert all(type(layer).__name__ == "LlamaDecoderLayer" for layer in model.model.layers)
    assert list(model.state_dict()) == keys
    before = _graphs()
    with torch.no_grad():
        model.generate(torch.tensor([[7, 8, 9]]), max_new_tokens=3, do_sample=False,
                       pad_token_id=tok.pad_token_id)
    assert _graphs() == before


def _shared_prompt_batch(tok, prompt_len: int, resp_len: int, seed: int):
    """Two prompts with two responses each (the shared-prefix layout pays off)."""
    ids, mask, pos, _ = _batch(tok, prompt_len, resp_len, seed)
    rows = torch.tensor([0, 0, 2, 2])
    ids, mask = ids[rows].clone(), mask[rows].clone()
    ids[1, prompt_len:] = ids[1, prompt_len:].flip(0)
    ids[3, prompt_len:] = ids[3, prompt_len:].roll(1)
    pos = torch.clamp(mask.cumsum(-1) - 1, min=0)
    return ids, mask, pos, ids[:, prompt_len:]


@pytest.mark.parametrize("variant", ["packed", "gradient_checkpointing", "lora",
                                     pytest.param("shared_prefix", marks=pytest.mark.slow)])  # ~19 s of inductor
def test_compiled_layers_equal_eager_with_other_features(tok, variant):
    """use_remove_padding (one packed row), activation checkpointing (recomputed through the compiled
    layer), LoRA adapters (peft layers inside the compiled layer, non-zero so they matter), the
    shared-prefix layout (a [G, 1, L, L] mask into the compiled layer)."""
    model = tiny_llama(tok)
    if variant == "gradient_checkpointing":
        enable_activation_checkpointing(model.train())
    if variant == "lora":
        settings = lora_settings(ActorModelConfig(path="<tiny>", lora_rank=4, lora_alpha=8), "actor_rollout_ref.model")
        apply_lora(model, settings, model_path="<tiny>", model_dtype="fp32", seed=0)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1)
    packed, shared = variant == "packed", variant == "shared_prefix"
    make = _shared_prompt_batch if shared else _batch
    batches = [make(tok, 5, 4, 0), make(tok, 7, 6, 1)]
    want = [_logprobs_and_grads(model, b, packed, shared) for b in batches]
    enable_layer_compile(model)
    got = [_logprobs_and_grads(model, b, packed, shared) for b in batches]
    for (lp, _, grads), (lp_c, _, grads_c) in zip(want, got):
        torch.testing.assert_close(lp_c, lp, rtol=1e-5, atol=1e-5)
        assert grads_c.keys() == grads.keys()
        for name in grads:
            torch.testing.assert_close(grads_c[name], grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_compiled_layers_swap_only_inside_the_block(tok):
    model = tiny_llama(tok)
    originals = list(model.model.layers)
    with compiled_layers(model):  # not enabled: nothing changes
        assert list(model.model.layers) == originals
    enable_layer_compile(model)
    with compiled_layers(model):
        assert all(isinstance(layer, torch._dynamo.eval_frame.OptimizedModule) for layer in model.model.layers)
        assert [layer._orig_mod for layer in model.model.layers] == originals
    assert list(model.model.layers) == originals
    assert decoder_layers(model) is model.model.layers
    disable_layer_compile(model)
    with compiled_layers(model):  # disabled again: eager
        assert list(model.model.layers) == originals


def test_sharded_module_and_layerless_module_refused(tok, monkeypatch):
    with pytest.raises(ValueError, match="no list of decoder layers"):
        enable_layer_compile(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    monkeypatch.setattr(compile_mod, "is_sharded", lambda module: True)
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.compile_layers=True is not supported on FSDP2"):
        enable_layer_compile(tiny_llama(tok))


@pytest.mark.slow  # a tiny run compiled by inductor (~15 s on 2 Zen 3 cores): `python -m pytest -m slow`
def test_tiny_run_with_compiled_layers_equals_eager_run(tmp_path):
    """The trainer wires the key to the actor and the reference: step 1 (same weights, same samples)
    has the eager run's losses, and the compiled scorer agrees with the eager engine's log-probs."""
    from helpers.tiny_run import tiny_trainer

    common = ["actor_rollout_ref.actor.use_kl_loss=True", "trainer.total_training_steps=2"]
    eager = tiny_trainer(tmp_path / "eager", common)
    compiled = tiny_trainer(tmp_path / "compiled", common + ["actor_rollout_ref.model.compile_layers=True"])
    assert hasattr(compiled.workers.actor.module, compile_mod._ATTR)
    assert hasattr(compiled.workers.ref.module, compile_mod._ATTR)
    assert not hasattr(eager.workers.actor.module, compile_mod._ATTR)
    torch._dynamo.reset()  # graphs of earlier tests (same layer code and shapes) would otherwise be reused
    before = _graphs()
    want, got = eager.fit(), compiled.fit()
    assert _graphs() > before
    for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
        assert got[0][key] == pytest.approx(want[0][key], rel=1e-4, abs=1e-6), key
    assert max(row["training/rollout_actor_probs_diff_max"] for row in got) < 1e-4


def test_tiny_ppo_run_compiles_the_critic_too(tmp_path):
    from helpers.tiny_run import tiny_trainer

    common = ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1", "trainer.total_training_steps=1"]
    eager = tiny_trainer(tmp_path / "eager", common)
    compiled = tiny_trainer(tmp_path / "compiled", common + ["actor_rollout_ref.model.compile_layers=True"])
    assert hasattr(compiled.workers.critic.module, compile_mod._ATTR)  # critic.model.compile_layers follows
    want, got = eager.fit(), compiled.fit()
    for key in ("critic/values/mean", "critic/vf_loss", "critic/grad_norm", "actor/pg_loss"):
        assert got[0][key] == pytest.approx(want[0][key], rel=1e-4, abs=1e-6), key
