"""verl 0.9's engine SFT (`python -m posttrain.trainer.sft_trainer`, the keys of verl's
`sft_trainer_engine.yaml`): its keys map onto posttrain's SFT tree, a run trains the same numbers as the
same run written with the older `fsdp_sft_trainer` keys, the entry never exits 0 having trained nothing,
and verl's GSM8K script shape runs under torchrun on 1 and 2 ranks (slow)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config.sft_engine import load_engine_sft_config, to_sft_config
from posttrain.data.schema import write_rows
from posttrain.errors import ConfigError
from helpers.tiny_run import tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"


def _message_rows(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i % 7} + {i % 5}?"},
                          {"role": "assistant", "content": f"{i % 7} + {i % 5} = {i % 7 + i % 5}\n#### {i % 7 + i % 5}"}]}
            for i in range(n)]


def _engine_overrides(tmp_path: Path, extra: list[str] = ()) -> list[str]:
    data = tmp_path / "data"
    if not (data / "train.parquet").exists():
        write_rows(_message_rows(16), str(data / "train.parquet"))
        write_rows(_message_rows(8), str(data / "test.parquet"))
    return [f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
            "data.messages_key=messages", "data.micro_batch_size_per_gpu=4", "data.train_batch_size=8",
            "data.use_dynamic_bsz=False", "data.max_length=128", "engine=fsdp", "engine.dtype=float32",
            f"model.path={tiny_model_dir(tmp_path)}", "model.enable_gradient_checkpointing=False",
            "model.use_remove_padding=false", "optim.lr=1e-3", "trainer.device=cpu", "trainer.logger=[file]",
            f"trainer.default_local_dir={tmp_path / 'ckpt'}", "trainer.project_name=p",
            "trainer.experiment_name=e", "trainer.total_training_steps=2", "trainer.seed=3",
            "trainer.n_gpus_per_node=1", *extra]


def test_engine_keys_map_onto_the_sft_tree(tmp_path):
    engine = load_engine_sft_config(overrides=_engine_overrides(tmp_path, [
        "data.use_dynamic_bsz=True", "data.max_token_len_per_gpu=512", "optim.optimizer_impl=torch.optim",
        "optim.lr_scheduler_type=cosine", "engine.param_offload=True", "engine.dtype=bfloat16",
        "checkpoint.save_contents=[model,optimizer,extra,hf_model]", "trainer.resume_mode=disable",
        "profiler.enable=True", "engine.use_torch_compile=False"]))
    config = to_sft_config(engine)
    d, m, o, t = config.data, config.model, config.optim, config.trainer
    assert d.multiturn.enable and d.multiturn.messages_key == "messages"
    assert (d.use_dynamic_bsz, d.max_token_len_per_gpu, d.micro_batch_size_per_gpu) == (True, 512, 4)
    assert m.partial_pretrain == str(tiny_model_dir(tmp_path)) and m.fsdp_config.param_offload
    assert m.fsdp_config.mixed_precision.param_dtype == "auto"  # bfloat16: bf16 where the machine computes in it
    assert (o.lr, o.lr_scheduler, o.optimizer) == (1e-3, "cosine", "auto")
    assert t.resume_mode == "disable" and t.device == "cpu" and "hf_model" in t.checkpoint.save_contents
    assert sorted(k.split("=")[0] for k in engine.no_effect) == ["engine.use_torch_compile", "profiler.enable"]


@pytest.mark.parametrize("override, needle", [
    ("engine=megatron", "Megatron-LM"),
    ("engine.strategy=veomni", "VeOmni"),
    ("engine.qat.enable=True", "quantization-aware"),
    ("data.messages_kee=messages", "unknown SFT config key 'data.messages_kee'"),
    ("engine.dtype=int8", "engine.dtype='int8'"),
])
def test_engine_bad_input_is_one_line(tmp_path, override, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        to_sft_config(load_engine_sft_config(overrides=_engine_overrides(tmp_path, [override])))


def test_engine_sft_trains_as_the_legacy_sft_keys_do(tmp_path):
    """The same rows, model and settings, once through verl 0.9's engine keys and once through the older
    fsdp_sft_trainer keys (multi-turn mode): the same losses step by step (an independent route to the same
    trainer); a different learning rate gives different losses (the comparison can fail)."""
    from posttrain.config.sft_load import load_sft_config
    from posttrain.trainer.sft_trainer import SFTTrainer

    engine_cfg = to_sft_config(load_engine_sft_config(overrides=_engine_overrides(tmp_path / "a")))
    engine_cfg.trainer.run_dir = str(tmp_path / "a" / "run")
    engine_hist = SFTTrainer(engine_cfg).fit()
    _engine_overrides(tmp_path / "b")  # the same rows in b's folder
    legacy = load_sft_config(overrides=[
        f"data.train_files={tmp_path / 'b' / 'data' / 'train.parquet'}",
        f"data.val_files={tmp_path / 'b' / 'data' / 'test.parquet'}", "data.multiturn.enable=True",
        "data.micro_batch_size_per_gpu=4", "data.train_batch_size=8", "data.max_length=128",
        f"model.partial_pretrain={tiny_model_dir(tmp_path / 'a')}", "model.enable_gradient_checkpointing=False",
        "model.fsdp_config.mixed_precision.param_dtype=fp32", "optim.lr=1e-3", "optim.betas=[0.9,0.999]",
        "optim.lr_warmup_steps_ratio=0", "optim.lr_scheduler=constant", "trainer.device=cpu",
        "trainer.logger=[file]", "trainer.n_gpus_per_node=1", f"trainer.default_local_dir={tmp_path / 'b' / 'ckpt'}",
        f"trainer.run_dir={tmp_path / 'b' / 'run'}", "trainer.total_training_steps=2", "trainer.seed=3"])
    legacy_hist = SFTTrainer(legacy).fit()
    losses = [[row["train/loss"] for row in h if "train/loss" in row] for h in (engine_hist, legacy_hist)]
    assert len(losses[0]) == 2 and all(math.isfinite(x) for x in losses[0])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-7)
    assert (tmp_path / "a" / "ckpt" / "hf_model" / "config.json").exists()
    assert losses[0][1] != pytest.approx(losses[0][0], rel=1e-6)  # it trained: the second step's loss moved


def _entry(args: list[str], cwd: Path, timeout: int = 600, launcher: list[str] | None = None):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, *(launcher or []), "-m", "posttrain.trainer.sft_trainer", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_entry_never_exits_zero_having_done_nothing(tmp_path):
    """verl's launch with a file that does not exist: one error line and a non-zero exit (it used to exit 0)."""
    proc = _entry(["data.train_files=missing.parquet", "model.path=foo", "trainer.n_gpus_per_node=1"], tmp_path)
    assert proc.returncode != 0
    assert "missing.parquet" in proc.stderr and "Traceback" not in proc.stderr
    ok = _entry(["--cfg", "job", *_engine_overrides(tmp_path)], tmp_path)
    assert ok.returncode == 0 and "multiturn:" in ok.stdout, ok.stderr[-2000:]


def _gsm8k_rows(tmp_path: Path) -> Path:
    from posttrain.data.prep import gsm8k_rows

    records = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines()[:32]]
    out = tmp_path / "gsm8k"
    write_rows(gsm8k_rows(records, "train"), str(out / "train.parquet"))
    write_rows(gsm8k_rows(records[:8], "test"), str(out / "test.parquet"))
    return out


@pytest.mark.slow  # SmolLM2 under torchrun, 1 then 2 ranks, 2 steps each (minutes on 2 cores): `-m slow`
@pytest.mark.parametrize("ranks", [1, 2])
def test_verl_gsm8k_sft_script_shape_under_torchrun(tmp_path, ranks):
    """examples/sft/gsm8k/run_qwen2_5_0_5b_fsdp.sh's command, with SmolLM2 and GSM8K rows: trains 2 steps,
    saves its checkpoint and its model."""
    data = _gsm8k_rows(tmp_path)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc_per_node={ranks}"]
    proc = _entry([f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
                   "data.messages_key=messages", "data.micro_batch_size_per_gpu=2", "data.train_batch_size=4",
                   "optim.lr=1e-5", "engine=fsdp", "engine.ulysses_sequence_parallel_size=1",
                   "model.path=smollm2-135m-instruct", "model.use_remove_padding=true",
                   f"trainer.default_local_dir={tmp_path / 'ckpt'}", "trainer.project_name=gsm8k-sft",
                   "trainer.experiment_name=smollm2", "trainer.logger=['console']", "trainer.total_training_steps=2"],
                  tmp_path, timeout=1800, launcher=launcher)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 2/2" in proc.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (tmp_path / "ckpt" / "hf_model" / "model.safetensors").exists()
