"""`posttrain plan` with LoRA: no reference model is loaded (the actor with its adapters disabled is
the reference), gradients and AdamW state exist for the adapters alone, and the adapter count is the
published one.

Published figure: LoRA rank 8 on Llama-2-7B's q_proj and v_proj has 4,194,304 trainable parameters
(peft's print_trainable_parameters, the usual example): 32 layers x 2 projections x 8 x (4096 + 4096).
"""

import pytest

from posttrain.plan import build_plan
from posttrain.plan.flow import uses_models
from posttrain.plan.memory import ADAM_BYTES, GRAD_BYTES, GiB, lora_param_count
from posttrain.plan.model_dims import dims_from_args

LLAMA2_7B = dict(hidden=4096, layers=32, heads=32, kv_heads=32, vocab=32000, intermediate=11008)
GRPO_KL = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.use_kl_loss=True",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"]


def _config(*overrides):
    from posttrain.config import load_config

    return load_config(overrides=[*GRPO_KL, *overrides], validate=False)


def test_adapter_counts_match_the_published_figure():
    dims = dims_from_args(None, **LLAMA2_7B)
    assert lora_param_count(dims, 8, ["q_proj", "v_proj"]) == 4_194_304
    # all-linear, rank 32: 32 x (4 x (4096 + 4096) + 3 x (4096 + 11008)) per layer, 32 layers
    assert lora_param_count(dims, 32, "all-linear") == 32 * 32 * (4 * 8192 + 3 * 15104)
    assert lora_param_count(dims, 32, "all-linear", ["o_proj"]) == 32 * 32 * (3 * 8192 + 3 * 15104)
    assert lora_param_count(dims, 8, r".*\.layers\.0\.self_attn\.q_proj") == 8 * 8192  # a regex: one module


def test_reference_is_not_loaded_with_lora():
    ref = next(m for m in uses_models(_config("actor_rollout_ref.model.lora_rank=32")) if m["role"] == "reference")
    assert not ref["loaded"] and "adapters disabled" in ref["why"] and "use_kl_loss=True" in ref["why"]
    full = next(m for m in uses_models(_config()) if m["role"] == "reference")
    assert full["loaded"]


def test_memory_counts_adapter_gradients_and_no_reference_weights():
    dims = dims_from_args(None, **LLAMA2_7B)
    lora = build_plan(_config("actor_rollout_ref.model.lora_rank=32"), dims=dims).memory
    full = build_plan(_config(), dims=dims).memory
    adapters = 32 * 32 * (4 * 8192 + 3 * 15104)
    actor = lora.roles["actor"]
    assert actor["lora_params"] == adapters
    assert actor["grads"] + actor["optimizer"] == pytest.approx(adapters * (GRAD_BYTES + ADAM_BYTES) / 8)
    assert actor["params"] == pytest.approx((dims.params + adapters) * 4 / 8)  # fp32 base + adapters, 8 ranks
    assert lora.roles["reference"]["params"] == 0 and full.roles["reference"]["params"] == pytest.approx(dims.params * 4 / 8)
    rollout = next(p for p in lora.phases if p.name == "rollout")
    assert not any("reference" in t.name for t in rollout.terms)
    saved = next(n for n in lora.notes if n.startswith("LoRA: no reference model"))
    assert f"{dims.params * 4 / 8 / GiB:.1f} GiB per GPU saved" in saved
    update = lambda m: next(p for p in m.phases if p.name == "actor update").total  # noqa: E731
    assert full.roles["actor"]["grads"] - actor["grads"] == pytest.approx((dims.params - adapters) * GRAD_BYTES / 8)
    assert update(full) - update(lora) > 5 * GiB  # 12 B/param of a 6.7B model over 8 ranks, minus the adapters'
