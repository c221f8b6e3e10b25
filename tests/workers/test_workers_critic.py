"""CriticWorker on a tiny random Llama backbone (CPU, fp32)."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.algorithms import compute_value_loss
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.models import value_model_from_lm
from posttrain.rollout import SamplingParams
from posttrain.workers import CriticWorker
from helpers.tiny_models import grads_at_step, tiny_llama, tiny_prompt_batch, tiny_worker_configs


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def batch(tok):
    from posttrain.rollout.hf import HFRolloutEngine

    torch.manual_seed(3)
    engine = HFRolloutEngine(tiny_llama(tok), tok)
    out = engine.generate(tiny_prompt_batch(tok, ["1+1=", "hello 2*3=", "x"]),
                          SamplingParams(n=2, temperature=1.0, response_length=8))
    mask = out["response_mask"].clone()
    mask[0, 2:] = 0
    out.batch["response_mask"] = mask
    out.batch["attention_mask"][:, -8:] = mask
    g = torch.Generator().manual_seed(4)
    out.batch["values"] = 0.3 * torch.randn(mask.shape, generator=g) * mask
    out.batch["returns"] = torch.randn(mask.shape, generator=g) * mask
    return out


def make_critic(tok, head_seed=None, **critic_kw):
    cfg = tiny_worker_configs(critic=critic_kw)
    module = value_model_from_lm(tiny_llama(tok))
    if head_seed is not None:
        torch.manual_seed(head_seed)
        torch.nn.init.normal_(module.value_head.weight, std=0.5)
    return CriticWorker(cfg.critic, device="cpu", module=module)


def spy_shared_layouts(monkeypatch) -> list[bool]:
    """Whether each shared-prompt forward took its layout (True) or fell back to the plain one."""
    import posttrain.models.logprobs as logprobs

    taken, real = [], logprobs.shared_prefix_hidden_states

    def spy(*args, **kwargs):
        hidden = real(*args, **kwargs)
        taken.append(hidden is not None)
        return hidden

    monkeypatch.setattr(logprobs, "shared_prefix_hidden_states", spy)
    return taken


def manual_values(module, b):
    """Reference: value head on the full-sequence hidden states, columns P-1 .. P+R-2."""
    resp_len = b["responses"].shape[1]
    hidden = module.hidden_states(b["input_ids"], b["attention_mask"], b["position_ids"])
    return module.values_from_hidden(hidden)[:, -resp_len - 1:-1] * b["response_mask"]


def test_zero_init_head_gives_zero_values(tok, batch):
    critic = make_critic(tok)
    assert torch.count_nonzero(critic.compute_values(batch)) == 0


@pytest.mark.parametrize("packed,shared", [(False, False), (True, False), (False, True)])
def test_compute_values_reads_state_before_each_response_token(tok, batch, packed, shared, monkeypatch):
    critic = make_critic(tok, head_seed=0, forward_micro_batch_size_per_gpu=4, use_prefix_grouper=shared)
    critic.remove_padding = packed
    layouts = spy_shared_layouts(monkeypatch)
    values = critic.compute_values(batch)
    assert any(layouts) == shared  # the shared-prompt layout ran (and only when asked)
    with torch.no_grad():
        want = manual_values(critic.module, batch)
    torch.testing.assert_close(values, want, rtol=1e-5, atol=1e-5)
    assert torch.all(values[batch["response_mask"] == 0] == 0)


@pytest.mark.parametrize("mode,shared", [("token-mean", False), ("seq-mean-token-mean", False),
                                         ("seq-mean-token-sum-norm", False), ("token-mean", True)])
def test_update_grad_accumulation_equals_one_big_batch(tok, batch, mode, shared, monkeypatch):
    critic = make_critic(tok, head_seed=0, ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=4,
                         loss_agg_mode=mode, cliprange_value=0.2, use_prefix_grouper=shared)
    layouts = spy_shared_layouts(monkeypatch)
    reference = copy.deepcopy(critic.module)
    got = grads_at_step(critic)
    metrics = critic.update_critic(batch)
    assert any(layouts) == shared
    vpreds = manual_values(reference, batch)
    vf_loss, clipfrac = compute_value_loss(vpreds, batch["returns"], batch["values"], batch["response_mask"],
                                           0.2, mode)
    vf_loss.backward()
    for (name, _), q in zip(critic.module.named_parameters(), reference.parameters()):
        scale = float(q.grad.abs().max())
        torch.testing.assert_close(got[name], q.grad, rtol=2e-4, atol=1e-5 * scale, msg=lambda m: f"{name}: {m}")
    assert metrics["critic/vf_loss"] == pytest.approx(float(vf_loss.detach()), rel=1e-4)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(float(clipfrac), rel=1e-4, abs=1e-6)
    for key in ("critic/vpred_mean", "critic/grad_norm", "critic/lr"):
        assert key in metrics


def _value_error(critic, batch):
    """Mean squared error of the critic's values against the returns over the response tokens."""
    mask = batch["response_mask"].bool()
    return float(((critic.compute_values(batch) - batch["returns"])[mask] ** 2).mean())


@pytest.mark.parametrize("lr, learns", [(1e-2, True), (0.0, False)])
def test_critic_learns_returns(tok, batch, lr, learns):
    """The mechanism, not a speed: from a seeded start, 40 epochs of value updates on one batch bring
    the values close to its returns; with lr 0 (the control) nothing moves."""
    torch.manual_seed(0)
    critic = make_critic(tok, ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=6, ppo_epochs=20,
                         cliprange_value=100.0, optim=type(tiny_worker_configs().critic.optim)(lr=lr))
    before = _value_error(critic, batch)
    for _ in range(2):
        critic.update_critic(batch)
    after = _value_error(critic, batch)
    if learns:
        assert after < 0.25 * before, (before, after)
    else:
        assert after == pytest.approx(before, rel=1e-6)
