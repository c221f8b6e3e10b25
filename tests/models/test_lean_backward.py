"""`keep_less_for_backward`: under bf16 autocast the linear layers keep their fp32 weights (not a bf16 cast
of each), the decoder layers' RMSNorms keep their inputs (not their outputs and three casts of them), the
SwiGLU keeps gate and up (not the activation, nor the product its down projection reads) — the same forward,
the same gradients up to bf16 rounding, less kept by autograd."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers.saved import kept_for_backward
from helpers.tokenizer import build_tiny_tokenizer
from helpers.tiny_models import tiny_llama
from posttrain.distributed.placement import InProcess
from posttrain.models.lean.backward import RecastLinear, keep_less_for_backward


def _loss_grads_and_kept_bytes(model: nn.Module, ids: torch.Tensor, autocast: bool = True):
    """Loss, every parameter's gradient, and the bytes autograd keeps for backward (each storage once;
    parameters are in memory anyway and count 0)."""
    model.zero_grad(set_to_none=True)
    with kept_for_backward() as kept:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, kept.bytes


def _float64_grads(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    exact = copy.deepcopy(model).double()
    exact(ids, labels=ids).loss.backward()
    return {n: p.grad for n, p in exact.named_parameters() if p.grad is not None}


def _assert_no_further_from_float64(grads: dict, grads_lean: dict, exact: dict) -> None:
    """Each lean gradient is float32 and no further from float64's than autocast's own (up to 20%)."""
    for name, reference in exact.items():
        grad, grad_lean = grads[name], grads_lean[name]
        assert grad_lean.dtype == torch.float32
        # bf16 autocast is ~1e-2 from float64 here; the lean layers must be no further from it
        reference = reference.float()
        scale = reference.norm()
        error, error_lean = (grad - reference).norm() / scale, (grad_lean - reference).norm() / scale
        assert error_lean <= max(1.2 * error, 1e-3), (name, error.item(), error_lean.item())


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
    _assert_no_further_from_float64(grads, grads_lean, _float64_grads(plain, ids))
    h, i, t, layers = 128, 344, 4 * 48, 3
    linear_weights = sum(m.weight.numel() for m in plain.modules() if isinstance(m, nn.Linear))
    # per layer: each norm's fp32 output, and its bf16 casts but one (3 readers before attention, 2 before
    # the MLP); silu(gate) and silu(gate) * up in bf16
    per_layer = (4 * t * h + 2 * 2 * t * h) + (4 * t * h + 1 * 2 * t * h) + 2 * (2 * t * i)
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


class _UnfusedRecastLinear(RecastLinear):
    """The same layer under another class: `LeanSwiGLU` fuses only an exact `RecastLinear`, so an MLP whose
    ``down_proj`` is this one takes the unfused path (down_proj keeping its input, the product)."""


def _mlp(mlp_bias: bool, down_proj_class: type | None) -> nn.Module:
    """One lean SwiGLU MLP (hidden 64, intermediate 160, seeded), its ``down_proj`` switched to
    ``down_proj_class``; None: autocast's own layers."""
    torch.manual_seed(0)
    mlp = tiny_llama(build_tiny_tokenizer(), intermediate_size=160, mlp_bias=mlp_bias).model.layers[0].mlp
    if down_proj_class is not None:
        keep_less_for_backward(mlp)
        mlp.down_proj.__class__ = down_proj_class
    return mlp


def _mlp_output_grads_and_kept_bytes(mlp: nn.Module, x: torch.Tensor):
    """One forward and backward under bf16 autocast of ``x`` (bf16, as `LeanRMSNorm` hands it out): the
    output, the gradients of ``x`` and of every parameter, and the bytes autograd keeps (each storage once,
    parameters 0)."""
    x = x.detach().requires_grad_()
    mlp.zero_grad(set_to_none=True)
    with kept_for_backward() as kept:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = mlp(x)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype))
    grads = {"x": x.grad, **{n: p.grad for n, p in mlp.named_parameters()}}
    return out.detach(), grads, kept.bytes


@pytest.mark.parametrize("mlp_bias", [False, True])
def test_the_swiglu_keeps_gate_and_up_but_not_the_product_with_the_same_bits(mlp_bias):
    t, h, i = 2 * 24, 64, 160
    x = torch.randn(2, 24, h).to(torch.bfloat16)
    out, grads, _ = _mlp_output_grads_and_kept_bytes(_mlp(mlp_bias, None), x)
    out_fused, grads_fused, kept_fused = _mlp_output_grads_and_kept_bytes(_mlp(mlp_bias, RecastLinear), x)
    out_unfused, grads_unfused, kept_unfused = _mlp_output_grads_and_kept_bytes(
        _mlp(mlp_bias, _UnfusedRecastLinear), x)
    assert out_fused.dtype == torch.bfloat16
    assert torch.equal(out_fused, out) and torch.equal(out_fused, out_unfused)
    for name, grad in grads.items():
        assert torch.equal(grads_fused[name], grads_unfused[name]), name  # the same ops in the same order
        assert torch.equal(grads_fused[name], grad), name  # and autocast's own, here
    # bf16 bytes: x (read by gate and up, one storage), gate and up; the unfused path also keeps the product
    assert kept_fused == 2 * t * (h + 2 * i)
    assert kept_unfused == 2 * t * (h + 3 * i)


def _backward_node_names(output: torch.Tensor) -> set[str]:
    names, seen, stack = set(), set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_a_lora_down_proj_keeps_the_unfused_path_and_trains():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = tiny_llama(build_tiny_tokenizer(), intermediate_size=160)
    # random A and B (peft's default B = 0 would leave A without gradient)
    lora = peft.LoraConfig(r=4, target_modules=["down_proj", "up_proj"], init_lora_weights=False)
    plain = peft.get_peft_model(base, lora)
    lean = copy.deepcopy(plain)
    assert keep_less_for_backward(lean)["swiglu"] == 2
    mlp = lean.base_model.model.model.layers[0].mlp
    assert type(mlp).__name__ == "LeanLlamaMLP"
    assert isinstance(mlp.down_proj, peft.tuners.lora.Linear) and isinstance(mlp.down_proj.base_layer, RecastLinear)

    ids = torch.randint(0, base.config.vocab_size, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        nodes = _backward_node_names(lean(ids, labels=ids).loss)
    assert "_SiluTimesBackward" in nodes and "_SiluTimesDownBackward" not in nodes
    loss, grads, _ = _loss_grads_and_kept_bytes(plain, ids)
    loss_lean, grads_lean, _ = _loss_grads_and_kept_bytes(lean, ids)
    assert loss_lean == loss
    exact = _float64_grads(plain, ids)
    assert sorted(exact) == sorted(n for n, p in lean.named_parameters() if p.requires_grad)
    assert all("lora_" in n for n in exact)  # the adapters, and only they, get gradients
    _assert_no_further_from_float64(grads, grads_lean, exact)


def test_a_hooked_down_proj_keeps_its_forward_and_its_hook_runs():
    """The fused path skips ``down_proj``'s forward; a hook on it (a user's probe, an adapter) must still see it."""
    mlp = _mlp(False, RecastLinear)
    seen = []
    mlp.down_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    x = torch.randn(2, 24, 64).to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mlp(x)
    assert seen == [out.shape]
    nodes = _backward_node_names(out)
    assert "_SiluTimesBackward" in nodes and "_SiluTimesDownBackward" not in nodes
