"""Workers built from a saved checkpoint folder (the path a real run takes), bf16 autocast and
activation checkpointing on: one rollout -> log-probs -> values -> updates, all finite."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.tokenizer import build_tiny_tokenizer
from posttrain.config.roles import RoleSpec, RoleSpecs
from posttrain.distributed.placement import InProcess
from posttrain.workers.build import build_roles
from helpers.tiny_models import tiny_llama, tiny_prompt_batch, tiny_worker_configs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    tok = build_tiny_tokenizer()
    tiny_llama(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), tok


def test_full_step_from_folder_bf16_checkpointing(ckpt):
    path, tok = ckpt
    cfg = tiny_worker_configs(param_dtype="bf16", n=2, response_length=6, mini_batch_size=8, micro_batch_size=2,
                              actor=dict(use_kl_loss=True))
    cfg.model.path, cfg.model.enable_gradient_checkpointing = path, True
    cfg.critic.model.path, cfg.critic.model.enable_gradient_checkpointing = path, True
    cfg.critic.enable = True
    specs = RoleSpecs(RoleSpec(cfg.model, cfg.actor.fsdp_config, cfg.actor, cfg.rollout),
                      ref=RoleSpec(cfg.model, cfg.ref.fsdp_config, cfg.ref, cfg.rollout),
                      critic=RoleSpec(cfg.critic.model, cfg.critic.model.fsdp_config, cfg.critic))
    roles = build_roles(specs, InProcess("cpu"), 0)  # every role loaded from the folder
    actor, ref, critic = roles.actor, roles.ref, roles.critic
    assert actor.tokenizer.pad_token_id == tok.pad_token_id

    torch.manual_seed(0)
    batch = actor.generate_sequences(tiny_prompt_batch(tok, ["1+1=", "2+2=", "abc", "x"]))
    old, entropy = actor.compute_log_prob(batch)
    batch.batch["old_log_probs"] = old
    batch.batch["ref_log_prob"] = ref.compute_ref_log_prob(batch)
    # the same weights, kept in bf16 by the reference (posttrain.distributed.placement.store_frozen_in_bf16): every
    # matmul reads the bf16 weight the actor's autocast reads; the norm scales and embeddings round to bf16
    assert {p.dtype for p in ref.module.parameters()} == {torch.bfloat16}
    torch.testing.assert_close(batch["ref_log_prob"], old, rtol=0, atol=0.01)  # measured 0.002
    batch.batch["values"] = critic.compute_values(batch)
    mask = batch["response_mask"].float()
    batch.batch["advantages"] = torch.randn(mask.shape) * mask
    batch.batch["returns"] = torch.randn(mask.shape) * mask

    actor_metrics = actor.update_policy(batch)
    critic_metrics = critic.update_critic(batch)
    assert actor_metrics["actor/grad_norm"] > 0 and critic_metrics["critic/grad_norm"] > 0
    # one mini-batch: on-policy, up to bf16 rounding (the update's micro-batches pad differently from
    # the log-prob pass's, and bf16 matmuls round by shape: |ppo_kl| ~1e-4 on these samples)
    assert actor_metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-3)
    for value in [*actor_metrics.values(), *critic_metrics.values()]:
        assert math.isfinite(value)
    new, _ = actor.compute_log_prob(batch)
    assert not torch.allclose(new, old)
