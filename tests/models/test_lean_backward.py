"""`keep_less_for_backward`: under bf16 autocast the linear layers keep their fp32 weights (not a bf16 cast
of each), the decoder layers' RMSNorms keep their inputs (not their outputs and three casts of them), the
SwiGLU keeps gate and up — the same forward, the same gradients up to bf16 rounding, less kept by autograd."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers.tokenizer import build_tiny_tokenizer
from helpers.tiny_models import tiny_llama
from posttrain.host.placement import InProcess
from posttrain.models.lean_backward import RecastLinear, keep_less_for_backward


def _loss_grads_and_kept_bytes(model: nn.Module, ids: torch.Tensor, autocast: bool = True):
    """Loss, every parameter's gradient, and the bytes autograd keeps for backward (each storage once;
    parameters are in memory anyway and count 0)."""
    model.zero_grad(set_to_none=True)
    kept = {}

    def pack(t):
        if not isinstance(t, nn.Parameter):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, sum(kept.values())


def _float64_grads(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    exact = copy.deepcopy(model).double()
    exact(ids, labels=ids).loss.backward()
    return {n: p.grad for n, p in exact.named_parameters()}


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    plain = tiny_llama(build_tiny_tokenizer(), hidden_size=128, intermediate_size=344, num_hidden_layers=3)
    lean = copy.deepcopy(plain)
    # q k v o gate up down per layer and the head; two norms per layer (not the final one); one MLP per layer
    assert keep_less_for_backward(lean) == {"linear": 3 * 7 + 1, "rms_norm": 3 * 2, "swiglu": 3}
    return plain, lean


def test_the_same_forward_gradients_as_close_to_float64_and_less_kept(models):
    plain, lean = models
    ids = torch.randint(0, plain.config.vocab_size, (4, 48))
    loss, grads, kept = _loss_grads_and_kept_bytes(plain, ids)
    loss_lean, grads_lean, kept_lean = _loss_grads_and_kept_bytes(lean, ids)
    assert loss_lean == loss  # the same bf16 products
    exact = _float64_grads(plain, ids)
    for name, grad in grads.items():
        assert grads_lean[name].dtype == torch.float32
        # bf16 autocast is ~1e-2 from float64 here; the lean layers must be no further from it
        reference = exact[name].float()
        scale = reference.norm()
        error, error_lean = (grad - reference).norm() / scale, (grads_lean[name] - reference).norm() / scale
        assert error_lean <= max(1.2 * error, 1e-3), (name, error.item(), error_lean.item())
    h, i, t, layers = 128, 344, 4 * 48, 3
    linear_weights = sum(m.weight.numel() for m in plain.modules() if isinstance(m, nn.Linear))
    # per layer: each norm's fp32 output, and its bf16 casts but one (3 readers before attention, 2 before
    # the MLP); silu(gate) in bf16
    per_layer = (4 * t * h + 2 * 2 * t * h) + (4 * t * h + 1 * 2 * t * h) + 2 * t * i
    assert kept - kept_lean == 2 * linear_weights + layers * per_layer


def test_without_autocast_or_gradients_they_are_the_original_layers(models):
    plain, lean = models
    ids = torch.randint(0, plain.config.vocab_size, (2, 16))
    loss, grads, kept = _loss_grads_and_kept_bytes(plain, ids, autocast=False)
    loss_lean, grads_lean, kept_lean = _loss_grads_and_kept_bytes(lean, ids, autocast=False)
    assert (loss_lean, kept_lean) == (loss, kept)
    assert all(torch.equal(grads_lean[n], g) for n, g in grads.items())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # scoring: bit-identical logits
        assert torch.equal(lean(ids).logits, plain(ids).logits)


def test_a_trained_bf16_role_gets_it_and_a_frozen_or_fp32_one_does_not():
    tok = build_tiny_tokenizer()
    place = InProcess("cpu")
    fsdp = {"param_offload": False}
    trained = place.shard(tiny_llama(tok), fsdp, "bf16")
    frozen = place.shard(tiny_llama(tok), fsdp, "bf16", forward_only=True)
    fp32 = place.shard(tiny_llama(tok), fsdp, "fp32")
    assert isinstance(trained.model.layers[0].mlp.down_proj, RecastLinear)
    assert type(trained.model.layers[0].input_layernorm).__name__ == "LeanLlamaRMSNorm"
    assert type(trained.model.norm).__name__ == "LlamaRMSNorm"  # the final norm's readers are not only linears
    lean_types = ("RecastLinear", "LeanLlamaRMSNorm", "LeanLlamaMLP")
    assert not any(type(m).__name__ in lean_types for m in [*frozen.modules(), *fp32.modules()])
