"""RLHFDataset renders the tools the rollout offers into the prompt (verl's data.tool_config_path, which
follows actor_rollout_ref.rollout.multi_turn.tool_config_path): apply_chat_template(..., tools=schemas)."""

import json
from pathlib import Path

import yaml

from helpers.data import make_data_config
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.data import RLHFDataset, write_rows

ROOT = Path(__file__).resolve().parents[2]
CALCULATOR_YAML = ROOT / "examples/tool_config/calculator_tool_config.yaml"
# A template with a tools block, as Qwen's: one JSON schema per line between <tools> tags, before the turns.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = [{"role": "user", "content": "What is 12 * 34?"}]


def _rows_file(tmp_path):
    path = str(tmp_path / "rows.parquet")
    write_rows([{"data_source": "posttrain/arithmetic", "prompt": QUESTION,
                 "reward_model": {"style": "rule", "ground_truth": "408"}, "extra_info": {"index": 0}}], path)
    return path


def _yaml_schemas():
    """The schemas as the YAML file writes them: the independent reference."""
    return [entry["tool_schema"] for entry in yaml.safe_load(CALCULATOR_YAML.read_text())["tools"]]


def test_prompt_renders_the_tool_schemas(tmp_path):
    tok = build_tiny_tokenizer(TOOLS_TEMPLATE)
    dataset = RLHFDataset(_rows_file(tmp_path), tok, make_data_config(max_prompt_length=1024,
                                                                       tool_config_path=str(CALCULATOR_YAML)))
    schemas = _yaml_schemas()
    assert dataset.tool_schemas == schemas
    text = tok.decode(dataset.input_ids[0])
    want = ("<|im_start|>system\n<tools>\n" + "".join(json.dumps(s) + "\n" for s in schemas) + "</tools><|im_end|>\n"
            "<|im_start|>user\nWhat is 12 * 34?<|im_end|>\n<|im_start|>assistant\n")
    assert text == want
    assert '"name": "calculator"' in text
    # the length a prompt is filtered or refused by counts the tools block
    assert len(dataset.input_ids[0]) == len(tok(want, add_special_tokens=False)["input_ids"])


def test_negative_controls_no_tool_config_and_a_template_without_tools(tmp_path):
    plain = "<|im_start|>user\nWhat is 12 * 34?<|im_end|>\n<|im_start|>assistant\n"
    tok = build_tiny_tokenizer(TOOLS_TEMPLATE)
    no_tools = RLHFDataset(_rows_file(tmp_path), tok, make_data_config(max_prompt_length=1024))
    assert no_tools.tool_schemas is None
    assert tok.decode(no_tools.input_ids[0]) == plain
    # a template that ignores tools (SmolLM2's kind) renders the same prompt with or without them
    tiny = build_tiny_tokenizer()
    ignored = RLHFDataset(_rows_file(tmp_path), tiny, make_data_config(max_prompt_length=1024,
                                                                        tool_config_path=str(CALCULATOR_YAML)))
    assert ignored.tool_schemas == _yaml_schemas()
    assert tiny.decode(ignored.input_ids[0]) == plain


def test_data_tool_config_path_follows_the_multi_turn_key():
    from posttrain.config import load_config

    assert load_config(validate=False).data.tool_config_path is None
    mt = "actor_rollout_ref.rollout.multi_turn"
    config = load_config(overrides=[f"{mt}.tool_config_path={CALCULATOR_YAML}"], validate=False)
    assert config.data.tool_config_path == str(CALCULATOR_YAML)
    # the data key can still be set on its own (verl's key)
    config = load_config(overrides=[f"{mt}.tool_config_path={CALCULATOR_YAML}", "data.tool_config_path=null"],
                         validate=False)
    assert config.data.tool_config_path is None


def test_a_bad_tool_config_is_an_error_at_start_up(tmp_path):
    import pytest

    from posttrain.errors import ConfigError

    with pytest.raises(ConfigError, match="missing.yaml"):
        RLHFDataset(_rows_file(tmp_path), build_tiny_tokenizer(TOOLS_TEMPLATE),
                    make_data_config(max_prompt_length=1024, tool_config_path=str(tmp_path / "missing.yaml")))
