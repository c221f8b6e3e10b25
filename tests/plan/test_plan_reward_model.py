"""`posttrain plan` with a reward model: the PPO blog script plus FsfairX-LLaMA3-RM-v0.1 (verl's default
reward model path, a Llama-3-8B sequence classifier), checked by hand on 8 x 80 GiB."""

import json

import pytest

from posttrain.plan import build_plan, resolve_dims
from posttrain.plan.flow import build_flow, uses_models
from posttrain.plan.memory import GiB

# Llama-3-8B's shape (published config.json) saved as a one-label sequence classifier
LLAMA3_8B_RM = {
    "architectures": ["LlamaForSequenceClassification"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 8192, "tie_word_embeddings": False, "num_labels": 1,
}


@pytest.fixture
def rm_dir(tmp_path):
    folder = tmp_path / "FsfairX-LLaMA3-RM-v0.1"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B_RM))
    return folder


def _config(load_script, ppo_script, rm_dir, *extra):
    return load_script(ppo_script, "reward_model.enable=True", f"reward_model.model.path={rm_dir}",
                       "reward_model.micro_batch_size_per_gpu=16", *extra)


def test_reward_model_forward_pass_and_why(ppo_script, rm_dir, load_script):
    config = _config(load_script, ppo_script, rm_dir)
    f = build_flow(config)
    # 1024 responses / 8 ranks = 128 per rank; micro 16 -> 8 reward-model forwards per rank
    assert ("reward model score", 16, 8) in [(p.name, p.micro_batch, p.rounds) for p in f.forward_passes]
    rm = next(m for m in uses_models(config) if m["role"] == "reward model")
    assert rm["loaded"] and rm["model"] == str(rm_dir)
    assert "replaces the rule-based reward" in rm["why"] and "re-renders each chat" in rm["why"]
    summed = next(m for m in uses_models(_config(load_script, ppo_script, rm_dir, "reward_model.combine=sum"))
                  if m["role"] == "reward model")
    assert "added to the rule-based reward" in summed["why"]


def test_reward_model_memory_by_hand(ppo_script, rm_dir, deepseek_dir, load_script):
    config = _config(load_script, ppo_script, rm_dir)
    dims, why = resolve_dims(config, str(deepseek_dir))
    m = build_plan(config, dims=dims, dims_reason=why).memory
    rm = m.roles["reward model"]
    # Llama-3-8B has 8.03e9 parameters; a scalar head replaces its 128256 x 4096 LM head: 7.50e9,
    # fp32 (model_dtype) sharded over 8 GPUs = 3.75 GB per GPU
    params = 8.03e9 - 128256 * 4096 + 4096
    assert rm["params"] == pytest.approx(params * 4 / 8, rel=0.005)
    # forward of 16 sequences x 1024 tokens, no logits: (4 h + 4 i) B per token = 4 x (4096 + 14336) x 16384
    assert rm["forward_activations"] == 4 * (4096 + 14336) * 16 * 1024
    phase = next(p for p in m.phases if p.name == "reward model score")
    assert any(t.name == "reward model parameters" for t in phase.terms)
    rollout = next(p for p in m.phases if p.name == "rollout")
    assert any(t.name == "reward model parameters" for t in rollout.terms)  # resident: param_offload=False
    offloaded = build_plan(_config(load_script, ppo_script, rm_dir, "reward_model.model.fsdp_config.param_offload=True"),
                           dims=dims).memory
    rollout = next(p for p in offloaded.phases if p.name == "rollout")
    assert not any("reward model" in t.name for t in rollout.terms)


def test_reward_model_shape_unknown_assumes_the_actors(ppo_script, deepseek_dir, load_script, tmp_path):
    config = load_script(ppo_script, "reward_model.enable=True", f"reward_model.model.path={tmp_path / 'elsewhere'}",
                         "reward_model.micro_batch_size_per_gpu=16")
    dims, why = resolve_dims(config, str(deepseek_dir))
    m = build_plan(config, dims=dims, dims_reason=why).memory
    assert any("actor's shape assumed" in n for n in m.notes)
    assert m.roles["reward model"]["params"] == pytest.approx(m.roles["critic"]["params"])  # both: actor minus LM head
