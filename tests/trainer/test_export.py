"""posttrain export: a checkpoint's actor becomes a Hugging Face folder that generates like the original."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.tokenizer import build_tiny_tokenizer
from posttrain.checkpoint import CheckpointManager, RoleState
from posttrain.trainer.export import export_actor, main


def _tiny_model(vocab_size: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # weights a fresh init would not have
        model.model.layers[1].mlp.down_proj.weight.mul_(3.0)
        model.model.embed_tokens.weight[5:9] += 0.5  # tied: lm_head changes too
    return model


def _greedy(model, tok, prompt: str = "12+7=") -> list[int]:
    ids = torch.tensor([tok.encode(prompt)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tok = build_tiny_tokenizer()
    model = _tiny_model(len(tok))
    root = tmp_path_factory.mktemp("ckpt")
    model.config.quantization_config = {"quant_method": "gguf"}  # as a GGUF-loaded model carries
    actor = RoleState(model=model.state_dict(), hf_config=model.config, tokenizer=tok)
    CheckpointManager(root).save(4, {"actor": actor}, {"step": 4})
    del model.config.quantization_config
    return root, model, tok


def test_export_generates_the_same_greedy_tokens(saved, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, model, tok = saved
    assert main([str(root), "--output", str(tmp_path / "hf")]) == 0  # a root exports its latest
    assert "global_step_4" in capsys.readouterr().out

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    exported_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (tmp_path / "hf" / "model.safetensors").exists()
    original = model.state_dict()
    for key, value in exported.state_dict().items():
        assert torch.equal(value, original[key]), key
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()  # still tied
    assert exported_tok.encode("12+7=") == tok.encode("12+7=")
    tokens = _greedy(model, tok)
    assert _greedy(exported, exported_tok) == tokens
    assert len(tokens) == 8


def test_export_accepts_the_step_and_actor_folders(saved, tmp_path):
    root, model, _ = saved
    for i, path in enumerate([root / "global_step_4", root / "global_step_4" / "actor"]):
        out = export_actor(path, tmp_path / f"out{i}")
        assert (out / "config.json").exists() and (out / "tokenizer_config.json").exists()


def test_export_of_a_non_checkpoint_fails_clearly(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "--output", str(tmp_path / "out")]) == 2
    assert "is not a checkpoint: give a global_step_N folder" in capsys.readouterr().err
    (tmp_path / "global_step_1").mkdir()
    assert main([str(tmp_path / "global_step_1"), "-o", str(tmp_path / "out")]) == 2
    assert "COMPLETE marker" in capsys.readouterr().err


def test_export_never_writes_into_the_checkpoint_it_reads(saved, tmp_path):
    root, _, _ = saved
    step = root / "global_step_4"
    before = sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
    for out in (step, step / "actor", step / "exported", root):
        with pytest.raises(Exception, match="inside or around the checkpoint"):
            export_actor(step, out)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(Exception, match="exists and is not an exported model folder"):
        export_actor(step, tmp_path / "notes")
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == before


def test_an_interrupted_export_leaves_the_previous_one_or_nothing(saved, tmp_path, monkeypatch):
    """A full disk (or a kill) in the middle of writing: no half-written folder that looks complete;
    the error names the cause and the path."""
    import errno

    from posttrain.checkpoint import CheckpointError
    from transformers import PreTrainedModel

    root, _, _ = saved
    out = tmp_path / "hf"
    real = PreTrainedModel.save_pretrained

    def full_disk(self, folder, *args, **kwargs):
        real(self, folder, *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device", str(folder))

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    with pytest.raises(CheckpointError, match=r"exporting to .*hf failed: cannot write .*: No space left on device "
                                              r"\(ENOSPC: the disk is full\); free space there, or pass another --output"):
        export_actor(root, out)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp_export")]
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real)
    export_actor(root, out)
    first = (out / "model.safetensors").read_bytes()
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    with pytest.raises(CheckpointError):
        export_actor(root, out)
    assert (out / "model.safetensors").read_bytes() == first  # the previous export is intact



def test_a_full_disk_inside_safetensors_is_the_same_clear_error(saved, tmp_path, monkeypatch):
    """safetensors reports a full disk as its own error type, the errno only in its text: found all the same."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    from posttrain.checkpoint import CheckpointWriteError

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    root, _, _ = saved
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    with pytest.raises(CheckpointWriteError, match=rf"exporting to {tmp_path / 'hf'} failed: cannot write {tmp_path}: "
                                                   r"No space left on device \(ENOSPC: the disk is full\)"):
        export_actor(root, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp_export")]
