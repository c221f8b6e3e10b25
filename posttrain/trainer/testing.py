"""Tiny end-to-end runs for tests: a char-level tokenizer, a 2-layer random Llama, the arithmetic
task written to a temporary folder, and a config sized to run a step in about a second."""

from __future__ import annotations

from pathlib import Path

from posttrain.config import load_config
from posttrain.data.arithmetic import write_arithmetic_parquet
from posttrain.data.testing import build_tiny_tokenizer

TINY_OVERRIDES = [
    "trainer.n_gpus_per_node=1", "trainer.device=cpu", "trainer.logger=[file]", "trainer.val_before_train=False",
    "trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.save_freq=-1",
    "data.train_batch_size=4", "data.max_prompt_length=192", "data.max_response_length=8",
    "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3",
    "actor_rollout_ref.model.enable_gradient_checkpointing=False",
    "critic.model.enable_gradient_checkpointing=False",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
    "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=fp32",
    "critic.model.fsdp_config.mixed_precision.param_dtype=fp32",
]


def tiny_model_dir(tmp_path: Path, seed: int = 0) -> Path:
    """A saved tiny Llama + tokenizer folder (so the critic and export load real files)."""
    from posttrain.workers.testing import tiny_llama

    out = Path(tmp_path) / f"tiny_model_{seed}"
    if not (out / "config.json").exists():
        tok = build_tiny_tokenizer()
        tiny_llama(tok, seed=seed).save_pretrained(out)
        tok.save_pretrained(out)
    return out


def tiny_config(tmp_path: Path, overrides: list[str] = (), n_train: int = 64, n_test: int = 8):
    tmp_path = Path(tmp_path)
    data_dir = tmp_path / "data"
    if not (data_dir / "train.parquet").exists():
        write_arithmetic_parquet(str(data_dir), n_train=n_train, n_test=n_test, digits=1, ops=("+",), seed=0)
    model = tiny_model_dir(tmp_path)
    base = TINY_OVERRIDES + [
        f"data.train_files={data_dir / 'train.parquet'}", f"data.val_files={data_dir / 'test.parquet'}",
        f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.run_dir={tmp_path / 'run'}",
        "algorithm.adv_estimator=grpo",
    ]
    return load_config(overrides=base + list(overrides))


def tiny_trainer(tmp_path: Path, overrides: list[str] = ()):
    from posttrain.trainer.trainer import RLTrainer

    return RLTrainer(tiny_config(tmp_path, overrides))
