"""The builder's steps (`posttrain.workers.prepare`): a worker built directly from a raw module is made
ready by the same steps as one the builder hands a ready module, LoRA is injected once, and a role
whose precision is ``auto`` follows the actor's."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_models import tiny_llama, tiny_worker_configs
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.workers import ActorWorker
from posttrain.distributed.placement import InProcess
from posttrain.workers.prepare import follow_actor, prepare
from posttrain.workers.reward_model import RewardModelWorker


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _lora_configs():
    cfg = tiny_worker_configs()
    cfg.model.lora_rank, cfg.model.lora_alpha = 4, 8
    return cfg


def _adapters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters() if "lora_" in name}


def test_a_directly_built_actor_equals_one_built_from_a_prepared_module(tok):
    cfg = _lora_configs()
    direct = ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=tiny_llama(tok, seed=1),
                         tokenizer=tok, seed=3)
    ready = prepare("policy", cfg.model, cfg.actor.fsdp_config, InProcess("cpu"), section="actor_rollout_ref.model",
                    module=tiny_llama(tok, seed=1), seed=3)
    built = ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=ready.module, tokenizer=tok, seed=3,
                        lora=ready.lora, param_dtype=ready.param_dtype)
    a, b = _adapters(direct.module), _adapters(built.module)
    assert a.keys() == b.keys() and len(a) == 2 * 7 * 2  # lora_A and lora_B of 7 linears in 2 layers: added once
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert direct.param_dtype == built.param_dtype == "fp32"
    # negative control: another seed draws other adapters
    other = prepare("policy", cfg.model, cfg.actor.fsdp_config, InProcess("cpu"), section="actor_rollout_ref.model",
                    module=tiny_llama(tok, seed=1), seed=4)
    assert not all(torch.equal(a[n], p) for n, p in _adapters(other.module).items())


def test_a_role_whose_precision_is_auto_follows_the_actor():
    cfg = tiny_worker_configs(param_dtype="auto")
    assert follow_actor(cfg.ref.fsdp_config, "bf16") == "bf16"
    cfg = tiny_worker_configs(param_dtype="fp32")
    assert follow_actor(cfg.ref.fsdp_config, "bf16") == "fp32"  # its own, when set


def test_a_reward_model_with_auto_precision_needs_the_decided_one(tok):
    from types import SimpleNamespace

    config = SimpleNamespace(model=SimpleNamespace(fsdp_config=SimpleNamespace(
        mixed_precision=SimpleNamespace(param_dtype="auto"))))
    module = torch.nn.Linear(2, 1)
    module.config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(pad_token_id=0))
    with pytest.raises(ValueError, match="param_dtype=auto follows the actor"):
        RewardModelWorker(module, config, rm_tokenizer=tok)
    assert RewardModelWorker(module, config, rm_tokenizer=tok, param_dtype="fp32").param_dtype == "fp32"
