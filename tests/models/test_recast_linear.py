"""`recast_weights_in_backward`: under bf16 autocast the linear layers keep their fp32 weights, not a bf16
cast of each, for backward — the same gradients as autocast's own linear, and less kept by autograd."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers.tokenizer import build_tiny_tokenizer
from helpers.tiny_models import tiny_llama
from posttrain.host.placement import InProcess
from posttrain.models.recast_linear import RecastLinear, recast_weights_in_backward


def _loss_grads_and_kept_bytes(model: nn.Module, ids: torch.Tensor, autocast: bool = True):
    """Loss, every parameter's gradient, and the bytes autograd keeps for backward (parameters themselves
    are in memory anyway and count 0)."""
    kept = []

    def pack(t):
        kept.append(0 if isinstance(t, nn.Parameter) else t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, sum(kept)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    plain = tiny_llama(build_tiny_tokenizer(), hidden_size=128, intermediate_size=344, num_hidden_layers=3)
    recast = copy.deepcopy(plain)
    assert recast_weights_in_backward(recast) == 3 * 7 + 1  # q k v o gate up down per layer, and the head
    return plain, recast


def test_same_gradients_as_autocast_and_no_weight_casts_kept(models):
    plain, recast = models
    ids = torch.randint(0, plain.config.vocab_size, (4, 48))
    loss, grads, kept = _loss_grads_and_kept_bytes(plain, ids)
    loss_r, grads_r, kept_r = _loss_grads_and_kept_bytes(recast, ids)
    assert loss_r == loss
    for name, grad in grads.items():  # the same bf16 matmuls: equal to the bit on this CPU
        torch.testing.assert_close(grads_r[name], grad, rtol=1e-3, atol=1e-6, msg=name)
        assert grads_r[name].dtype == torch.float32
    # the bf16 casts autocast keeps: 2 bytes for every linear weight
    linear_params = sum(m.weight.numel() for m in plain.modules() if isinstance(m, nn.Linear))
    assert kept - kept_r == 2 * linear_params


def test_outside_bf16_autocast_it_is_nn_linear(models):
    plain, recast = models
    ids = torch.randint(0, plain.config.vocab_size, (2, 16))
    loss, grads, kept = _loss_grads_and_kept_bytes(plain, ids, autocast=False)
    loss_r, grads_r, kept_r = _loss_grads_and_kept_bytes(recast, ids, autocast=False)
    assert (loss_r, kept_r) == (loss, kept)
    assert all(torch.equal(grads_r[n], g) for n, g in grads.items())


def test_a_trained_bf16_role_gets_it_and_a_frozen_or_fp32_one_does_not():
    tok = build_tiny_tokenizer()
    place = InProcess("cpu")
    fsdp = {"param_offload": False}
    trained = place.shard(tiny_llama(tok), fsdp, "bf16")
    frozen = place.shard(tiny_llama(tok), fsdp, "bf16", forward_only=True)
    fp32 = place.shard(tiny_llama(tok), fsdp, "fp32")
    assert isinstance(trained.model.layers[0].mlp.down_proj, RecastLinear)
    assert not any(isinstance(m, RecastLinear) for m in [*frozen.modules(), *fp32.modules()])
