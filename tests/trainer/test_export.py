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


def _saved_weights(tmp_path, **config):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**shape, **config}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    return model, tmp_path / "model.safetensors"


def test_a_checkpoint_that_does_not_fit_its_config_names_the_keys(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    from posttrain.checkpoint import CheckpointError
    from posttrain.trainer.export import _load_strict

    model, path = _saved_weights(tmp_path, intermediate_size=96)
    other = AutoModelForCausalLM.from_config(LlamaConfig(**{**model.config.to_dict(), "intermediate_size": 64}))
    with pytest.raises(CheckpointError, match=r"shapes \['model.layers.0.mlp.down_proj.weight \[32, 96\] "
                                              r"\(model: \[32, 64\]\)"):
        _load_strict(other, path)
    state = load_file(path)
    state["extra.weight"] = state.pop("model.norm.weight")
    save_file(state, path)
    with pytest.raises(CheckpointError, match=r"missing \['model.norm.weight'\], unexpected \['extra.weight'\]"):
        _load_strict(model, path)


def test_the_export_reads_one_tensor_at_a_time(tmp_path):
    """The memory claim: loading the checkpoint into the export's model adds about one tensor to the
    process, not the file (a mapped whole-file load, the control, keeps every page it read)."""
    import threading
    import time

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from posttrain.trainer.export import _load_strict

    model, path = _saved_weights(tmp_path, hidden_size=512, intermediate_size=4096, num_hidden_layers=6)
    target = AutoModelForCausalLM.from_config(model.config)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    del model
    size = path.stat().st_size  # 213 MB, its largest tensor 8 MB

    def rss() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))

    def growth(load) -> float:
        peak, done = [rss()], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], rss())
                time.sleep(0.001)

        thread = threading.Thread(target=sample)
        base = peak[0]
        thread.start()
        try:
            load()
        finally:
            done.set()
            thread.join()
        return (max(peak[0], rss()) - base) / size

    read_one_at_a_time = growth(lambda: _load_strict(target, path))
    assert all(torch.equal(v, expected[k]) for k, v in target.state_dict().items())
    mapped_whole_file = growth(lambda: target.load_state_dict(load_file(path)))  # the control
    assert read_one_at_a_time < 0.25 < 0.8 < mapped_whole_file, (read_one_at_a_time, mapped_whole_file)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_checkpoint_and_export_files_follow_the_umask(tmp_path, umask, mode):
    """safetensors writes through mkstemp (mode 0600 whatever the umask): a checkpoint's and an export's
    files get what a plain open() would give, 0666 & ~umask, so others the umask allows can read the model."""
    import os
    import stat

    tok = build_tiny_tokenizer()
    model = _tiny_model(len(tok))
    before = os.umask(umask)
    try:
        CheckpointManager(tmp_path / "ckpt").save(1, {"actor": RoleState(model=model.state_dict(),
                                                                         hf_config=model.config, tokenizer=tok)}, {})
        export_actor(tmp_path / "ckpt", tmp_path / "hf")
    finally:
        os.umask(before)
    for folder in (tmp_path / "ckpt" / "global_step_1" / "actor", tmp_path / "hf"):
        assert stat.S_IMODE((folder / "model.safetensors").stat().st_mode) == mode, folder
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}
        assert set(modes.values()) == {mode}, modes
