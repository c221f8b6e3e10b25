"""Tiny end-to-end runs for tests: a char-level tokenizer, a 2-layer random Llama, the arithmetic
task written to a temporary folder, and a config sized to run a step in about a second."""

from __future__ import annotations

import contextlib
from pathlib import Path

from posttrain.config import load_config
from posttrain.data.arithmetic import write_arithmetic_parquet
from helpers.tokenizer import build_tiny_tokenizer

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
    from helpers.tiny_models import tiny_llama

    out = Path(tmp_path) / f"tiny_model_{seed}"
    if not (out / "config.json").exists():
        tok = build_tiny_tokenizer()
        tiny_llama(tok, seed=seed).save_pretrained(out)
        tok.save_pretrained(out)
    return out


def tiny_overrides(tmp_path: Path, extra: list[str] = (), n_train: int = 64, n_test: int = 8) -> list[str]:
    """The tiny run as `key=value` overrides (data and model written under `tmp_path` once), for
    `load_config(overrides=...)` or a `python -m posttrain.trainer.main_ppo ...` command line."""
    tmp_path = Path(tmp_path)
    data_dir = tmp_path / "data"
    if not (data_dir / "train.parquet").exists():
        write_arithmetic_parquet(str(data_dir), n_train=n_train, n_test=n_test, digits=1, ops=("+",), seed=0)
    model = tiny_model_dir(tmp_path)
    return TINY_OVERRIDES + [
        f"data.train_files={data_dir / 'train.parquet'}", f"data.val_files={data_dir / 'test.parquet'}",
        f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.run_dir={tmp_path / 'run'}",
        "algorithm.adv_estimator=grpo",
    ] + list(extra)


def digit_count_reward(batch):
    """A batch reward that varies between responses (so advantages and losses are non-zero) and is the same
    wherever it is computed: the share of response tokens whose id is a multiple of 7."""
    mask = batch["response_mask"].bool()
    digits = ((batch["responses"] % 7) == 0) & mask
    return digits.sum(-1).float() / mask.sum(-1).clamp(min=1)


def tiny_config(tmp_path: Path, overrides: list[str] = (), n_train: int = 64, n_test: int = 8):
    return load_config(overrides=tiny_overrides(tmp_path, overrides, n_train=n_train, n_test=n_test))


@contextlib.contextmanager
def one_thread():
    """torch on one thread while the tiny runs go: their 64-wide matmuls gain nothing from threads,
    and on a busy 2-core machine OpenMP's barriers make each one ~1000x slower (20 ms, not 20 us).
    Subprocesses get the same with ``OMP_NUM_THREADS=1``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_trainer(tmp_path: Path, overrides: list[str] = ()):
    from posttrain.trainer.trainer import RLTrainer

    return RLTrainer(tiny_config(tmp_path, overrides))


def run_main_ppo(argv: list[str], log_path: str) -> None:
    """`python -m posttrain.trainer.main_ppo ARGV` inside an already-started interpreter (the target of
    a multiprocessing "forkserver" child whose server preloaded torch and posttrain: a fresh process
    in ~1 s instead of ~8 s of imports). stdout and stderr go to `log_path`; exits with main's code."""
    import os
    import sys

    import torch

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    torch.set_num_threads(1)
    from posttrain.trainer.main_ppo import main

    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def record_pushes(trainer) -> list[dict]:
    """After each weight push of an async ``trainer``, read back what rollout worker 0 then holds; returns the
    list those reads go into (one state dict per push, in order)."""
    pushed, push = [], trainer._push

    def push_and_read():
        metrics = push()
        pushed.append(trainer.pool.call(0, "weights"))
        return metrics

    trainer._push = push_and_read
    return pushed
