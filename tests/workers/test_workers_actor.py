"""ActorWorker / RefWorker on a tiny random Llama (CPU, fp32)."""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch

from posttrain.batch import Batch
from posttrain.config.actor_rollout_ref import OptimConfig
from posttrain.algorithms import LOSS_AGG_MODES, agg_loss, get_policy_loss_fn, kl_penalty
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.rollout import SamplingParams
from posttrain.workers import ActorWorker, RefWorker
from helpers.tiny_models import grads_at_step, tiny_llama, tiny_prompt_batch, tiny_worker_configs

TEMP = 0.8
PROMPTS = ["1+1=", "hello 2*3=", "x", "what is 7-5?"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def make_actor(tok, **cfg_kw):
    cfg = tiny_worker_configs(temperature=TEMP, **cfg_kw)
    return ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=tiny_llama(tok), tokenizer=tok), cfg


@pytest.fixture(scope="module")
def train_batch(tok):
    """8 responses (4 prompts x 2) of varied length with old/ref log-probs and advantages."""
    actor, cfg = make_actor(tok, response_length=10)
    torch.manual_seed(1)
    out = actor.rollout.generate(tiny_prompt_batch(tok, PROMPTS), SamplingParams(n=2, temperature=TEMP,
                                                                                  response_length=10))
    mask = out["response_mask"].clone()
    mask[0, 3:] = 0  # make lengths differ for certain
    mask[1, 7:] = 0
    out.batch["response_mask"] = mask
    out.batch["attention_mask"][:, -10:] = mask
    lp, _ = actor.compute_log_prob(out)
    g = torch.Generator().manual_seed(2)
    out.batch["old_log_probs"] = (lp + 0.3 * torch.randn(lp.shape, generator=g)) * mask  # some ratios clip
    out.batch["ref_log_prob"] = (lp + 0.2 * torch.randn(lp.shape, generator=g)) * mask
    out.batch["advantages"] = torch.randn(lp.shape, generator=g) * mask
    out.meta_info["temperature"] = TEMP
    return out


def naive_logprobs(model, b):
    """Reference: full [B, R, V] logits, log-softmax, gather (what verl does without fusion)."""
    resp_len = b["responses"].shape[1]
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                   position_ids=b["position_ids"]).logits[:, -resp_len - 1:-1].float() / TEMP
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def one_big_batch_grads(model, b, actor_cfg):
    """Gradient of the whole-mini-batch loss with plain local aggregation (no accumulation)."""
    model.zero_grad()
    mode, mask = actor_cfg.loss_agg_mode, b["response_mask"]
    lp, ent = naive_logprobs(model, b)
    pg, _ = get_policy_loss_fn("vanilla")(b["old_log_probs"], lp, b["advantages"], mask, loss_agg_mode=mode,
                                          config=actor_cfg)
    loss = pg - actor_cfg.entropy_coeff * agg_loss(ent, mask, mode)
    loss = loss + actor_cfg.kl_loss_coef * agg_loss(kl_penalty(lp, b["ref_log_prob"], actor_cfg.kl_loss_type),
                                                    mask, mode)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, float(pg.detach())


CASES = [(mode, split) for mode in LOSS_AGG_MODES for split in ("rows", "tokens")] + [("token-mean", "packed")]


@pytest.mark.parametrize("mode,split", CASES)
def test_grad_accumulation_equals_one_big_batch(tok, train_batch, mode, split):
    """Micro-batches by rows (3,3,2), by tokens (dynamic bsz) or padding-free: same gradient."""
    extra = dict(loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    if split == "tokens":
        extra.update(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=60)  # ~2-3 rows per micro-batch
    if split == "packed":
        extra.update(use_remove_padding=True)
    actor, _ = make_actor(tok, mini_batch_size=8, micro_batch_size=3, actor=extra)
    ref_model = copy.deepcopy(actor.module)
    got = grads_at_step(actor)
    metrics = actor.update_policy(train_batch)
    assert all(p.grad is None for p in actor.module.parameters())  # freed after the update
    want, want_pg = one_big_batch_grads(ref_model, train_batch, actor.config)
    for name, _ in actor.module.named_parameters():
        scale = float(want[name].abs().max())
        torch.testing.assert_close(got[name], want[name], rtol=2e-4, atol=1e-5 * scale, msg=lambda m: f"{name}: {m}")
    assert metrics["actor/pg_loss"] == pytest.approx(want_pg, rel=1e-4, abs=1e-7)
    assert metrics["actor/nonfinite_skipped"] == 0


def test_averaging_micro_batch_means_would_differ(tok, train_batch):
    """Guard that the equivalence test can fail: the old per-micro-batch token-mean (verl #5625)."""
    model = tiny_llama(tok)
    model.zero_grad()
    mask = train_batch["response_mask"]
    lp, _ = naive_logprobs(model, train_batch)
    for rows in torch.arange(8).split(3):
        token_mean = agg_loss(-lp[rows] * train_batch["advantages"][rows], mask[rows], "token-mean")
        (token_mean / 3).backward(retain_graph=True)
    wrong = model.lm_head.weight.grad.clone()
    model.zero_grad()
    agg_loss(-lp * train_batch["advantages"], mask, "token-mean").backward()
    assert not torch.allclose(wrong, model.lm_head.weight.grad, rtol=1e-2)


def test_update_metrics_and_lr_schedule(tok, train_batch):
    optim = OptimConfig(lr=1e-3, weight_decay=0.0, lr_warmup_steps=2)
    actor, _ = make_actor(tok, mini_batch_size=4, micro_batch_size=2,
                          actor=dict(ppo_epochs=2, shuffle=True, use_kl_loss=True, optim=optim))
    m1 = actor.update_policy(train_batch)
    m2 = actor.update_policy(train_batch)
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower",
                "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/lr", "actor/nonfinite_skipped"):
        assert key in m1 and math.isfinite(m1[key]), key
    assert m1["actor/lr"] == 0.0 and m2["actor/lr"] == pytest.approx(0.5e-3)
    assert 0.0 <= m1["actor/pg_clipfrac"] <= 1.0 and m1["actor/entropy"] > 0


def test_nonfinite_loss_skips_step(tok, train_batch):
    actor, _ = make_actor(tok, mini_batch_size=8, micro_batch_size=4)
    before = copy.deepcopy(actor.module.state_dict())
    tensors = {k: v.clone() for k, v in train_batch.batch.items()}
    tensors["advantages"][0, 0] = float("nan")
    bad = Batch.from_dict(tensors, meta_info=dict(train_batch.meta_info))
    metrics = actor.update_policy(bad)
    assert metrics["actor/nonfinite_skipped"] == 1
    for k, v in actor.module.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_compute_log_prob_micro_batching_and_dynamic(tok, train_batch):
    actor, cfg = make_actor(tok, micro_batch_size=3)
    lp3, ent3 = actor.compute_log_prob(train_batch)
    want_lp, want_ent = naive_logprobs(actor.module, train_batch)
    mask = train_batch["response_mask"].bool()
    torch.testing.assert_close(lp3[mask], want_lp.detach()[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent3[mask], want_ent.detach()[mask], rtol=1e-5, atol=1e-5)
    assert torch.all(lp3[~mask] == 0)
    cfg.rollout.log_prob_use_dynamic_bsz, cfg.rollout.log_prob_max_token_len_per_gpu = True, 50
    lp_dyn, _ = actor.compute_log_prob(train_batch)
    torch.testing.assert_close(lp_dyn, lp3, rtol=1e-5, atol=1e-6)


def test_checkpoint_resume_matches_uninterrupted(tok, train_batch, tmp_path):
    kw = dict(mini_batch_size=4, micro_batch_size=2, actor=dict(shuffle=True))
    a, _ = make_actor(tok, **kw)
    a.update_policy(train_batch)
    a.save_checkpoint(tmp_path / "actor")
    a.update_policy(train_batch)
    b, _ = make_actor(tok, **kw)
    b.load_checkpoint(tmp_path / "actor")
    b.update_policy(train_batch)
    for (name, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    assert a.lr_scheduler.last_epoch == b.lr_scheduler.last_epoch == 2


def test_ref_worker_stays_at_initial_weights(tok, train_batch):
    actor, cfg = make_actor(tok, mini_batch_size=8, micro_batch_size=8)
    ref = RefWorker(tiny_llama(tok), cfg.ref, cfg.rollout, device="cpu")  # built like the actor, not copied
    before = ref.compute_ref_log_prob(train_batch)
    initial, _ = actor.compute_log_prob(train_batch)
    torch.testing.assert_close(before, initial)
    metrics = actor.update_policy(train_batch)
    assert metrics["actor/nonfinite_skipped"] == 0, metrics
    after_actor, _ = actor.compute_log_prob(train_batch)
    torch.testing.assert_close(ref.compute_ref_log_prob(train_batch), before)
    assert not torch.allclose(after_actor, initial)
    assert not any(p.requires_grad for p in ref.module.parameters())


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_unavailable_rollout_engine_fails_at_construction(tok):
    cfg = tiny_worker_configs()
    cfg.rollout.name = "vllm"
    with pytest.raises((RuntimeError, NotImplementedError), match="rollout.name=hf"):
        ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=tiny_llama(tok), tokenizer=tok)
