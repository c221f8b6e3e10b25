"""Fixtures for the plan tests: the two blog scripts (8 GPUs, one node) and deepseek-llm-7b's shape."""

import json
from pathlib import Path

import pytest

from posttrain.config.scripts import load_source, read_source

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# deepseek-ai/deepseek-llm-7b-chat's config.json (the shape fields), as published on the Hub.
DEEPSEEK_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_attention_heads": 32, "num_hidden_layers": 30, "num_key_value_heads": 32, "vocab_size": 102400,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


@pytest.fixture
def ppo_script():
    return EXAMPLES / "ppo_deepseek7b_gsm8k.sh"


@pytest.fixture
def grpo_script():
    return EXAMPLES / "grpo_deepseek7b_gsm8k.sh"


@pytest.fixture
def load_script():
    """load_script(path, *overrides) -> config, loaded as `plan` loads it (validate=False)."""
    return lambda path, *extra: load_source(read_source(str(path)), extra, validate=False)


@pytest.fixture
def deepseek_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_7B))
    return tmp_path
