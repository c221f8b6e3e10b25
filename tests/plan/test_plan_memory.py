"""The memory model against published figures, and the two blog scripts on 80 GiB GPUs.

Published figures used (tolerances stated at each assert):
- mixed-precision Adam needs 16 bytes per parameter before activations (ZeRO, Rajbhandari et al.
  2019, sec. 3.1: a 1.5B-parameter GPT-2 needs 24 GB);
- parameter counts of Llama-2-7B (6.74B), Llama-2-13B (13.0B), Llama-3-8B (8.03B), deepseek-llm-7b (6.91B);
- KV cache per token in bf16: Llama-2-7B 0.5 MiB (2 x 32 layers x 32 heads x 128 x 2 B),
  Llama-3-8B 128 KiB (8 kv heads);
- full activation recomputation stores 2 s b h bytes per layer (Korthikanti et al. 2022, sec. 5).
"""

import pytest

from posttrain.plan import build_plan, resolve_dims
from posttrain.plan.memory import (
    GiB,
    estimate_memory,
    kv_bytes_per_token,
    layer_activation_bytes_per_token,
    model_state_bytes_per_param,
    parse_bytes,
    training_activation_bytes,
)
from posttrain.plan.model_dims import dims_from_args, dims_from_hf_config, params_from_shape, value_model_dims

LLAMA2_7B = dict(hidden=4096, layers=32, heads=32, kv_heads=32, vocab=32000, intermediate=11008)
LLAMA2_13B = dict(hidden=5120, layers=40, heads=40, kv_heads=40, vocab=32000, intermediate=13824)
LLAMA3_8B = dict(hidden=4096, layers=32, heads=32, kv_heads=8, vocab=128256, intermediate=14336)


def test_sixteen_bytes_per_parameter():
    # fp32 params 4 + fp32 grads 4 + Adam m, v 8 = 16 B, the ZeRO figure for mixed-precision Adam
    assert model_state_bytes_per_param("fp32") == 16
    assert 1.5e9 * model_state_bytes_per_param() == pytest.approx(24e9)  # GPT-2 1.5B: 24 GB (exact)


@pytest.mark.parametrize("shape, published, tol", [
    (LLAMA2_7B, 6.74e9, 0.005), (LLAMA2_13B, 13.02e9, 0.005), (LLAMA3_8B, 8.03e9, 0.005)])
def test_parameter_count_from_shape(shape, published, tol):
    assert dims_from_args(None, **shape).params == pytest.approx(published, rel=tol)


def test_deepseek_config_json(deepseek_dir):
    from posttrain.plan.model_dims import read_model_config

    d = read_model_config(deepseek_dir)
    assert (d.hidden, d.layers, d.heads, d.kv_heads, d.head_dim, d.vocab) == (4096, 30, 32, 32, 128, 102400)
    assert d.params == pytest.approx(6.91e9, rel=0.005)  # the Hub lists 6.91B parameters
    # critic: the LM head (102400 x 4096 = 0.42B) becomes a 4096 x 1 value head
    assert value_model_dims(d).params == pytest.approx(d.params - 102400 * 4096 + 4096)


def test_kv_cache_per_token():
    llama2 = dims_from_args(None, **LLAMA2_7B)
    assert kv_bytes_per_token(llama2) == 2 * 32 * 32 * 128 * 2 == 0.5 * 1024**2  # 0.5 MiB, exact
    assert kv_bytes_per_token(llama2, tp=2) == 0.25 * 1024**2  # heads split across tensor-parallel ranks
    assert kv_bytes_per_token(dims_from_args(None, **LLAMA3_8B)) == 128 * 1024  # GQA: 8 kv heads


def test_bf16_weights_of_a_7b_model():
    # "a 7B model's bf16 weights take about 14 GB": 2 B x 6.74B = 13.5 GB (within 5% of 14 GB)
    assert 2 * dims_from_args(None, **LLAMA2_7B).params == pytest.approx(14e9, rel=0.05)


def test_activations_with_and_without_checkpointing():
    d = dims_from_args(None, **LLAMA2_7B)
    tokens = 4096
    per_layer = (16 * 4096 + 8 * 11008) * tokens  # stated constant: 16 h + 8 i bytes per token per layer
    assert layer_activation_bytes_per_token(d) * tokens == per_layer
    assert training_activation_bytes(d, tokens, checkpointing=False) == 32 * per_layer
    # full recomputation keeps each layer's input, 2 s b h bytes (Korthikanti et al.), plus one layer in backward
    assert training_activation_bytes(d, tokens, checkpointing=True) == 32 * 2 * 4096 * tokens + per_layer


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * GiB and parse_bytes("141GB") == 141e9 and parse_bytes("24") == 24 * GiB


def _plan(load_script, script, deepseek_dir, *extra, **kw):
    config = load_script(script, *extra)
    dims, why = resolve_dims(config, str(deepseek_dir))
    return build_plan(config, dims=dims, dims_reason=why, **kw)


def test_grpo_blog_script_on_80gib(grpo_script, deepseek_dir, load_script):
    m = _plan(load_script, grpo_script, deepseek_dir).memory
    p = 6.91e9
    actor = m.roles["actor"]
    # 16 B/param sharded over 8 GPUs: 4 + 4 + 8 = 16 x 6.91e9 / 8 = 13.8 GB per GPU
    assert actor["params"] + actor["grads"] + actor["optimizer"] == pytest.approx(16 * p / 8, rel=0.005)
    ro = m.roles["rollout"]
    # vllm: 0.6 x 80 GiB = 48 GiB; TP 2 is not applied, so each rank's engine holds all bf16 weights, 2 x 6.91 GB,
    # and all 32 kv heads: 2 x 30 layers x 32 x 128 x 2 B = 480 KiB per token
    assert ro["engine_budget"] == pytest.approx(0.6 * 80 * GiB)
    assert ro["tensor_parallel"] == 1 and ro["weights"] == pytest.approx(2 * p, rel=0.005)
    assert ro["kv_bytes_per_token"] == 2 * 30 * 32 * 128 * 2
    # each rank's engine has 640 responses (under max_num_seqs=1024), all at once, 1536 tokens each
    assert ro["kv_cache_needed"] == 640 * 1536 * ro["kv_bytes_per_token"]
    # reference is offloaded: not resident during rollout
    rollout = next(ph for ph in m.phases if ph.name == "rollout")
    assert not any("reference" in t.name for t in rollout.terms)
    assert rollout.total == pytest.approx(actor["params"] + actor["optimizer"] + 0.6 * 80 * GiB)
    # worst case (every response 1024 tokens): the update's 80 x 1024 scored tokens x 102400 logits are far over
    # what a micro-batch keeps for backward, so its chunks are recomputed: one float32 chunk of 16M live
    assert 80 * 1024 * 102400 > 1 << 26
    assert actor["logits"] == (1 << 24) * 4
    assert actor["micro_batch_tokens"] == 80 * 1536  # no prefix grouping: every row's prompt
    assert (m.level, m.peak_phase, m.largest_term) == ("fits", "actor update",
                                                       "actor activations (with gradient checkpointing)")
    # at a typical GSM8K length it fits
    typical = _plan(load_script, grpo_script, deepseek_dir, mean_tokens=400).memory
    assert typical.level == "fits" and typical.peak < 80 * GiB


def test_ppo_blog_script_fits_and_smaller_gpus_do_not(ppo_script, deepseek_dir, load_script):
    m = _plan(load_script, ppo_script, deepseek_dir).memory
    assert set(m.roles) == {"actor", "rollout", "critic"}
    # rollout phase: actor and critic states (params + Adam) stay resident next to 0.4 x 80 GiB of vllm
    a, c = m.roles["actor"], m.roles["critic"]
    rollout = next(ph for ph in m.phases if ph.name == "rollout")
    assert rollout.total == pytest.approx(a["params"] + a["optimizer"] + c["params"] + c["optimizer"] + 0.4 * 80 * GiB)
    assert m.level == "fits" and m.peak_phase == "rollout"
    small = _plan(load_script, ppo_script, deepseek_dir, gpu_memory=24 * GiB).memory
    assert small.level == "likely_oom" and "likely out of memory" in small.verdict


def test_offload_and_checkpointing_change_the_estimate(grpo_script, deepseek_dir, load_script):
    offload = ["actor_rollout_ref.actor.fsdp_config.param_offload=True",
               "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True"]
    m = _plan(load_script, grpo_script, deepseek_dir, *offload).memory
    rollout = next(ph for ph in m.phases if ph.name == "rollout")
    assert rollout.total == pytest.approx(0.6 * 80 * GiB)  # nothing of the actor stays on the GPU
    update = next(ph for ph in m.phases if ph.name == "actor update")
    assert any("loaded from CPU" in t.name for t in update.terms)
    no_gc = _plan(load_script, grpo_script, deepseek_dir, "actor_rollout_ref.model.enable_gradient_checkpointing=False").memory
    assert no_gc.roles["actor"]["activations"] == no_gc.roles["actor"]["activations_no_gc"] > 10 * no_gc.roles["actor"]["activations_gc"]


def test_rollout_share_too_small_for_weights(grpo_script, deepseek_dir, load_script):
    m = _plan(load_script, grpo_script, deepseek_dir, "actor_rollout_ref.rollout.gpu_memory_utilization=0.05").memory
    assert m.level == "likely_oom" and "no room for the rollout KV cache" in m.verdict


def test_memory_skipped_without_a_model_shape(grpo_script, load_script):
    config = load_script(grpo_script, "actor_rollout_ref.model.path=/nowhere/model")
    dims, why = resolve_dims(config)
    plan = build_plan(config, dims=dims, dims_reason=why)
    assert plan.memory is None and "/nowhere/model" in plan.memory_skipped and "--params" in plan.memory_skipped
    # parameters only: states are estimated, activations are not
    dims, _ = resolve_dims(config, params=7e9)
    m = build_plan(config, dims=dims).memory
    assert m.roles["actor"]["optimizer"] == pytest.approx(8 * 7e9 / 8) and "activations_gc" not in m.roles["actor"]
    assert any("not estimated" in n for n in m.notes)


def test_shape_only_fills_stated_assumptions():
    d = dims_from_hf_config({"hidden_size": 2048, "num_hidden_layers": 24}, "test")
    assert (d.heads, d.kv_heads, d.vocab) == (16, 16, 32000) and len(d.assumptions) == 4
    assert d.params == pytest.approx(params_from_shape(d))


def test_shared_prompts_and_kept_logits_follow_posttrains_own_forward(grpo_script, deepseek_dir, load_script):
    """use_prefix_grouper: each of a micro-batch's prompts once for its rollout.n responses; logits only for
    response tokens, all kept for backward when a micro-batch has at most 64M of them."""
    short = ["data.max_response_length=64", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10"]
    plain = _plan(load_script, grpo_script, deepseek_dir, *short).memory.roles["actor"]
    grouped = _plan(load_script, grpo_script, deepseek_dir, *short,
                    "actor_rollout_ref.actor.use_prefix_grouper=True").memory.roles["actor"]
    assert plain["micro_batch_tokens"] == pytest.approx(10 * (512 + 64))
    assert grouped["micro_batch_tokens"] == pytest.approx(2 * 512 + 10 * 64)  # rollout.n=5: 2 prompts for 10 responses
    assert grouped["activations"] < plain["activations"]
    scored = 10 * 64 * 102400  # under 64M: every chunk kept in bf16, plus one float32 chunk at a time
    assert plain["logits"] == pytest.approx(scored * 2 + min(scored, 1 << 24) * 4) == grouped["logits"]


def test_a_cpu_plan_says_what_becomes_of_freed_blocks():
    from posttrain.config import BUILTIN_CONFIG, load_config
    from posttrain.plan.memory import CpuTerms

    key = "actor_rollout_ref.actor.fsdp_config.host_memory"
    memory = CpuTerms.of(load_config(overrides=[f"{key}=memory"], base=BUILTIN_CONFIG), has_bf16=True)
    speed = CpuTerms.of(load_config(overrides=[f"{key}=speed"], base=BUILTIN_CONFIG), has_bf16=True)
    assert "go back to the kernel (host_memory=memory, asked)" in memory.describe()
    assert "kept for reuse (host_memory=speed, asked)" in speed.describe()
    ranks = CpuTerms.of(load_config(overrides=[f"{key}=memory", "trainer.n_gpus_per_node=2"], base=BUILTIN_CONFIG),
                        has_bf16=True)
    assert "host_memory" not in ranks.describe()  # ranks keep their own allocator policy
