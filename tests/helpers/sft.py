"""Tiny SFT and DPO runs for tests: arithmetic rows with worked answers (SFT) or preference pairs
(DPO), a saved 2-layer random Llama, and configs sized to take a step in well under a second."""

from __future__ import annotations

from pathlib import Path

from posttrain.data.schema import write_rows
from helpers.tiny_run import tiny_model_dir

SFT_KEYS = ["data.prompt_key=prompt", "data.response_key=extra_info", "data.response_dict_keys=[answer]"]


def tiny_common(tmp_path: Path, extra: list[str] = ()) -> list[str]:
    tmp_path = Path(tmp_path)
    return [f"model.partial_pretrain={tiny_model_dir(tmp_path)}", "model.enable_gradient_checkpointing=False",
            "trainer.n_gpus_per_node=1", "trainer.device=cpu", "trainer.logger=[file]", "optim.lr=1e-3",
            "optim.lr_warmup_steps_ratio=0", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
            f"trainer.run_dir={tmp_path / 'run'}", "data.max_length=256", "data.train_batch_size=8",
            "data.micro_batch_size_per_gpu=4", "trainer.seed=3", *extra]


def tiny_sft_overrides(tmp_path: Path, extra: list[str] = (), n_train: int = 32, n_test: int = 8) -> list[str]:
    from posttrain.data.prep_sft import write_arithmetic_sft

    data = Path(tmp_path) / "sft_data"
    if not (data / "train.parquet").exists():
        write_arithmetic_sft(str(data), n_train, n_test, 1, ("+",), 0, "instruct")
    return [f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}", *SFT_KEYS,
            *tiny_common(tmp_path, extra)]


def tiny_sft_config(tmp_path: Path, extra: list[str] = (), **kw):
    from posttrain.config.sft_load import load_sft_config

    return load_sft_config(overrides=tiny_sft_overrides(tmp_path, extra, **kw))


def write_pairs(path: Path, n: int = 16) -> Path:
    """Preference rows: 'What is a + b?' -> chosen the right sum, rejected a wrong one."""
    rows = [{"prompt": f"What is {i % 7} + {i % 5}?", "chosen": f"#### {i % 7 + i % 5}",
             "rejected": f"#### {i % 7 + i % 5 + 1 + i % 3}"} for i in range(n)]
    write_rows(rows, str(path))
    return path


def tiny_dpo_config(tmp_path: Path, extra: list[str] = ()):
    from posttrain.config.sft_load import load_dpo_config

    data = Path(tmp_path) / "pairs"
    if not (data / "train.jsonl").exists():
        write_pairs(data / "train.jsonl", 16)
        write_pairs(data / "test.jsonl", 8)
    return load_dpo_config(overrides=[f"data.train_files={data / 'train.jsonl'}",
                                      f"data.val_files={data / 'test.jsonl'}", *tiny_common(tmp_path, extra)])
