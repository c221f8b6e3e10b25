"""Checks a run makes before it loads any model, so that a mistake costs seconds, not a training run.

- every model path exists (a local folder or ``.gguf`` file), or is a hub id or the smollm2 alias;
- every data file exists and is a ``.parquet`` / ``.jsonl`` / ``.json`` file (rows are read and
  checked when the datasets are built, still before the models);
- the checkpoint folder can be created and written, no other run writes to it (a lock naming the
  other process), and its contents follow the rule of `posttrain.trainer.resume.prepare_folder`.

The custom reward file is imported (and its function checked) by the trainer before the models
load too. Each problem is a `ConfigError` (or a `CheckpointError`) naming the key and the value.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

from posttrain.config import ConfigError, PostTrainConfig, uses_critic
from posttrain.checkpoint import CheckpointManager

__all__ = ["check_data_files", "check_model_paths", "claim_checkpoint_folder", "model_path_problem", "preflight"]

# owner/name (or a bare legacy name such as gpt2): what the hub accepts as a repository id.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def model_path_problem(path: str) -> str | None:
    """Why ``path`` cannot name a model, or None: a local folder with config.json, a ``.gguf`` file,
    a hub id (``org/name``), or the ``smollm2-135m-instruct`` alias."""
    from posttrain.models.loading import SMOLLM2_ALIAS, resolve_model_path

    text = str(path)
    if text.lower() == SMOLLM2_ALIAS:
        try:
            resolve_model_path(text)
        except FileNotFoundError as err:
            return str(err)
        return None
    local = Path(os.path.expanduser(text))
    if local.suffix.lower() == ".gguf":
        return None if local.is_file() else f"{local} does not exist"
    if local.is_dir():
        if not (local / "config.json").is_file():
            return f"{local} is a folder without config.json (not a Hugging Face model folder)"
        return None
    if local.exists():
        return f"{local} is a file, not a model folder or a .gguf file"
    looks_local = text.startswith(("/", "./", "../", "~")) or text.count("/") > 1 or "\\" in text
    if looks_local or not _HUB_ID.fullmatch(text):
        return f"{text} does not exist (expected a local model folder, a .gguf file, a hub id such as " \
               f"Qwen/Qwen2.5-0.5B-Instruct, or {SMOLLM2_ALIAS})"
    return None


def check_model_paths(config: PostTrainConfig, actor_module: Any = None, critic_module: Any = None,
                      tokenizer: Any = None) -> list[str]:
    problems = []
    keys = []
    if actor_module is None or tokenizer is None:
        keys.append(("actor_rollout_ref.model.path", config.actor_rollout_ref.model.path))
    if config.data.tokenizer and tokenizer is None:
        keys.append(("data.tokenizer", config.data.tokenizer))
    if uses_critic(config) and critic_module is None:
        keys.append(("critic.model.path", config.critic.model.path))
    for key, value in keys:
        if value is None:
            problems.append(f"{key} is not set")
            continue
        problem = model_path_problem(value)
        if problem is not None:
            problems.append(f"{key}={value}: {problem}")
    return problems


def check_data_files(config: PostTrainConfig) -> list[str]:
    from posttrain.data.schema import SUPPORTED_SUFFIXES
    from posttrain.trainer.setup import data_files

    problems = []
    for key, files in zip(("data.train_files", "data.val_files"), data_files(config)):
        for file in files if isinstance(files, list) else [files]:
            path = Path(file)
            if not path.exists():
                problems.append(f"{key}: {file} does not exist")
            elif path.is_dir():
                problems.append(f"{key}: {file} is a folder; give {'/'.join(SUPPORTED_SUFFIXES)} files")
            elif not str(file).endswith(SUPPORTED_SUFFIXES):
                problems.append(f"{key}: {file} is not a {'/'.join(SUPPORTED_SUFFIXES)} file")
            elif not os.access(path, os.R_OK):
                problems.append(f"{key}: {file} is not readable")
    return problems


def claim_checkpoint_folder(config: PostTrainConfig, manager: CheckpointManager) -> None:
    """Create ``trainer.default_local_dir``, prove it is writable, lock it for this run (one writer),
    and apply the folder rule (`resume.prepare_folder`). Raises `CheckpointError` / `ConfigError`."""
    from posttrain.trainer.resume import prepare_folder

    root = manager.root
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".tmp_probe_{uuid.uuid4().hex}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"trainer.default_local_dir={root}: cannot create or write the checkpoint folder "
                          f"({err.strerror or err}); choose a writable folder") from None
    manager.lock()
    try:
        prepare_folder(config.trainer, manager)
    except BaseException:
        manager.unlock()
        raise


def preflight(config: PostTrainConfig, actor_module: Any = None, critic_module: Any = None,
              tokenizer: Any = None) -> None:
    """Model paths and data files: one `ConfigError` listing every problem."""
    problems = check_model_paths(config, actor_module, critic_module, tokenizer) + check_data_files(config)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems found before loading any model:\n" +
                          "\n".join(f"  - {p}" for p in problems))

