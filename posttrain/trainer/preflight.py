"""Checks a run makes before it loads any model, so that a mistake costs seconds, not a training run.

- every model path exists (a local folder or ``.gguf`` file), or is a hub id or the smollm2 alias;
- with ``reward_model.enable``: the reward model's config names a sequence-classification head with
  one label, its tokenizer (and ``input_tokenizer``) load, and ``external_lib`` imports;
- each LoRA role's target and exclude module names exist in its model (built on the meta device);
- every data file exists and is a ``.parquet`` / ``.jsonl`` / ``.json`` file (rows are read and
  checked when the datasets are built, still before the models), and each row's data_source has a
  built-in scorer when the run scores with them (`check_data_sources`, once the rows are read);
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

from posttrain.config import PostTrainConfig, uses_critic
from posttrain.errors import ConfigError, DataError
from posttrain.checkpoint import CheckpointManager
from posttrain.checkpoint.found import checkpoint_found
from posttrain.host.disk import folder_problem

__all__ = ["check_data_files", "check_data_sources", "check_lora_config", "check_model_paths", "check_reward_model",
           "check_run_dir", "claim_checkpoint_folder", "model_path_problem", "preflight"]

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
            return checkpoint_found(local) or f"{local} is a folder without config.json (not a Hugging Face model " \
                                              "folder)"
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
    judge = config.reward.reward_model  # a GenRM judge the run serves (a URL is asked at start-up instead)
    if judge.enable and judge.model_path and not str(judge.model_path).startswith(("http://", "https://")):
        keys.append(("reward.reward_model.model_path", judge.model_path))
    for key, value in keys:
        if value is None:
            problems.append(f"{key} is not set")
            continue
        problem = model_path_problem(value)
        if problem is not None:
            problems.append(f"{key}={value}: {problem}")
    return problems


def check_reward_model(config: PostTrainConfig, tokenizer: Any = None) -> list[str]:
    """``reward_model.*`` when enabled: the checkpoint is a one-label sequence classifier (read from its
    config.json, before any weights load), and the tokenizers the scoring needs load."""
    rm = config.reward_model
    if not rm.enable:
        return []
    m = rm.model
    try:
        from posttrain.models.reward_model import import_external_lib

        import_external_lib(m.external_lib)
    except ImportError as err:
        return [f"reward_model.model.external_lib={m.external_lib}: cannot import it ({err})"]
    problem = model_path_problem(m.path)
    if problem is not None:
        return [f"reward_model.model.path={m.path}: {problem}"]
    problem = _reward_model_head_problem(m)
    if problem is not None:
        return [f"reward_model.model.path={m.path}: {problem}"]
    rm_tokenizer, problem = _load_tokenizer_problem("reward_model.model.path", m.path, m.trust_remote_code)
    if problem is not None:
        return [problem]
    if m.input_tokenizer is None:
        return _same_vocabulary_problems(config, rm_tokenizer, tokenizer)
    problems = []
    if not getattr(rm_tokenizer, "chat_template", None):
        problems.append(f"reward_model.model.path={m.path}: its tokenizer has no chat template, which re-templating "
                        "needs (reward_model.model.input_tokenizer is set); set reward_model.model.input_tokenizer=null "
                        "to score the actor's tokens as they are")
    if str(m.input_tokenizer) != str(config.actor_rollout_ref.model.path):
        problem = model_path_problem(m.input_tokenizer)
        if problem is None:
            _, problem = _load_tokenizer_problem("reward_model.model.input_tokenizer", m.input_tokenizer,
                                                 m.trust_remote_code)
        else:
            problem = f"reward_model.model.input_tokenizer={m.input_tokenizer}: {problem}"
        problems += [problem] if problem else []
    return problems


def _reward_model_head_problem(m: Any) -> str | None:
    from posttrain.models.loading import load_config
    from posttrain.models.reward_model import head_problem

    try:
        hf_config = load_config(m.path, trust_remote_code=m.trust_remote_code, override_config=m.override_config)
    except (OSError, ValueError, KeyError) as err:  # unreadable config.json, unknown model type, offline hub id
        return f"cannot read its config ({_first_line(err)})"
    return head_problem(hf_config)


def _load_tokenizer_problem(key: str, path: str, trust_remote_code: bool) -> tuple[Any, str | None]:
    from posttrain.models import load_tokenizer

    try:
        return load_tokenizer(path, trust_remote_code=trust_remote_code), None
    except (OSError, ValueError, KeyError, TypeError) as err:  # no tokenizer files, offline hub id
        return None, f"{key}={path}: cannot load its tokenizer ({_first_line(err)})"


def _same_vocabulary_problems(config: PostTrainConfig, rm_tokenizer: Any, tokenizer: Any) -> list[str]:
    """``input_tokenizer=null`` feeds the actor's token ids to the reward model: their vocabularies must match."""
    if tokenizer is None:
        m = config.actor_rollout_ref.model
        tokenizer, problem = _load_tokenizer_problem("actor_rollout_ref.model.path", m.path, m.trust_remote_code)
        if problem is not None:
            return [problem]
    if rm_tokenizer.get_vocab() == tokenizer.get_vocab():
        return []
    return [f"reward_model.model.input_tokenizer=null feeds the actor's token ids to the reward model, but the "
            f"tokenizer of reward_model.model.path={config.reward_model.model.path} has another vocabulary than the "
            f"actor's; set reward_model.model.input_tokenizer={config.actor_rollout_ref.model.path} to re-render "
            "each chat with the reward model's template"]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def check_data_files(config: PostTrainConfig) -> list[str]:
    from posttrain.trainer.setup import data_files

    problems = []
    for key, files in zip(("data.train_files", "data.val_files"), data_files(config)):
        for file in files if isinstance(files, list) else [files]:
            problem = data_file_problem(file)
            if problem is not None:
                problems.append(f"{key}: {problem}")
    return problems


def data_file_problem(file: str | os.PathLike) -> str | None:
    """What keeps ``file`` from being a prompt file (missing, a folder, another kind of file, unreadable), or None."""
    from posttrain.data.schema import SUPPORTED_SUFFIXES

    path = Path(file)
    if not path.exists():
        return f"{file} does not exist"
    if path.is_dir():
        return f"{file} is a folder; give {'/'.join(SUPPORTED_SUFFIXES)} files"
    if not str(file).endswith(SUPPORTED_SUFFIXES):
        return f"{file} is not a {'/'.join(SUPPORTED_SUFFIXES)} file"
    if not os.access(path, os.R_OK):
        return f"{file} is not readable"
    return None


def check_data_sources(config: PostTrainConfig, reward_fn: Any, *, train: Any = None, val: Any = None) -> None:
    """Every ``data.reward_fn_key`` value the built-in scorers will meet in the ``train`` and ``val`` datasets
    (`posttrain.data.RLHFDataset`) has one: a `DataError` naming the file, a row and the value, before any model
    loads, instead of the scorer's at step 1. Runs whose reward function is their own (custom_reward_function.path,
    ``reward_fn=``) are not checked, nor training rows a reward model scores alone (reward_model.combine=replace)."""
    from posttrain.rewards import KNOWN_DATA_SOURCES, RewardManager, default_compute_score

    if not (isinstance(reward_fn, RewardManager) and reward_fn.compute_score is default_compute_score):
        return
    rm = config.reward_model
    checked = [val] if rm.enable and rm.combine == "replace" else [train, val]
    key = config.data.reward_fn_key
    for dataset in (d for d in checked if d is not None):
        unknown = {str(row.get(key)) for row in dataset.rows} - set(KNOWN_DATA_SOURCES)
        if unknown:
            raise DataError(f"{_first_row_with(dataset.files, key, unknown)}: {key}={sorted(unknown)[0]!r} has no "
                            f"built-in scorer (known: {', '.join(KNOWN_DATA_SOURCES)}; {len(unknown)} unknown value(s) "
                            "in all); set custom_reward_function.path and .name to a function that scores these rows "
                            "(Python: RLTrainer(config, reward_fn=...))")


def _first_row_with(files: list[str], key: str, values: set[str]) -> str:
    """``<file> row <i>``: where the first row whose ``key`` is one of ``values`` is (the files are read again,
    only on this error path: the dataset keeps no file per row)."""
    from posttrain.data.schema import read_rows

    for path in files:
        for i, row in enumerate(read_rows(path)):
            if str(row.get(key)) in values:
                return f"{path} row {i}"
    return ", ".join(files)


def check_run_dir(config: Any) -> list[str]:
    """The run folder (metrics, plots: ``trainer.run_dir``, default outputs/<project>/<experiment>) must
    be a folder or creatable as one; found here, not when the first metrics are written."""
    from posttrain.trainer.setup import run_dir

    path = run_dir(config)
    blocked = folder_problem(path)
    if not blocked:
        return []
    key = f"trainer.run_dir={config.trainer.run_dir}" if config.trainer.run_dir else (
        f"the run folder {path} (trainer.run_dir unset: outputs/<trainer.project_name>/<trainer.experiment_name>)")
    return [f"{key}: {blocked}; set trainer.run_dir to a folder (new or existing)"]


def claim_checkpoint_folder(config: PostTrainConfig, manager: CheckpointManager, fingerprint: dict | None = None) -> None:
    """Create ``trainer.default_local_dir``, prove it is writable, lock it for this run (one writer),
    and apply the folder rule (`resume.prepare_folder`; with this run's ``fingerprint``, whose results the
    folder holds). Raises `CheckpointError` / `ConfigError`."""
    from posttrain.trainer.resume import prepare_folder

    root = manager.root
    blocked = folder_problem(root)
    if blocked:
        raise ConfigError(f"trainer.default_local_dir={root}: {blocked}; set it to a folder (new or existing)")
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
        prepare_folder(config.trainer, manager, fingerprint)
    except BaseException:
        manager.unlock()
        raise


def check_lora_config(config: Any, actor_module: Any = None, critic_module: Any = None) -> None:
    """Start-up check of both roles' LoRA module names against the models' structure, built from
    their configs on the meta device (no weights loaded); in-memory modules are checked as given."""
    from posttrain.models.lora import check_lora_targets, lora_settings, meta_model

    roles = [("actor_rollout_ref.model", config.actor_rollout_ref.model, actor_module, True)]
    if uses_critic(config):
        roles.append(("critic.model", config.critic.model, critic_module, False))
    for section, model_config, module, causal_lm in roles:
        settings = lora_settings(model_config, section)
        if settings is None or settings.adapter_path:
            continue
        if module is None:
            module = meta_model(model_config)
            if not causal_lm:  # the critic adapts the causal LM's backbone
                from posttrain.models.value_model import backbone_of

                module = backbone_of(module)
        elif not causal_lm:
            module = module.backbone
        head = module.get_output_embeddings() if causal_lm and hasattr(module, "get_output_embeddings") else None
        check_lora_targets(module, settings, head)


def preflight(config: PostTrainConfig, actor_module: Any = None, critic_module: Any = None,
              tokenizer: Any = None) -> None:
    """Model paths and data files: one `ConfigError` listing every problem."""
    problems = (check_model_paths(config, actor_module, critic_module, tokenizer) + check_data_files(config)
                + check_reward_model(config, tokenizer) + check_run_dir(config))
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems found before loading any model:\n" +
                          "\n".join(f"  - {p}" for p in problems))

