"""On-policy distillation in the RL step (``distillation.enabled``): the start-up checks that need the
tokenizer and the data, the objective the actor's update runs, and the teachers' pass.

The step (`posttrain.trainer.trainer.RLTrainer.train_step`) is the RL step with two changes: after the
old log-probs, the teachers score every sampled token (`score`: ``teacher_log_probs``, and for a top-k
loss mode ``teacher_topk_ids`` / ``teacher_topk_log_probs``), and the actor's update runs the `Distill`
objective (`posttrain.algorithms.objectives.Distill`) instead of plain PPO. Rewards and advantages are
computed as in every RL run (the task rewards' PPO loss, with ``use_task_rewards``; logged either way).
"""

from __future__ import annotations

from typing import Any

from posttrain.algorithms.objectives import Distill
from posttrain.batch import Batch
from posttrain.config.distillation import (SINGLE_TEACHER_KEY, distillation_enabled, resolve_teachers,
                                           teacher_entry_names)
from posttrain.errors import ConfigError

__all__ = ["distillation_objective", "prepare", "score", "teacher_problems"]

_ITEM_COLUMNS = ("data_source", "reward_model", "extra_info", "index", "ability", "agent_name", "raw_prompt")
"""Columns every prompt item carries already (`posttrain.data.rl_dataset.RLHFDataset.__getitem__`)."""


def distillation_objective(config: Any) -> Distill | None:
    """The actor's objective of a distillation run (None: plain PPO)."""
    if not distillation_enabled(config):
        return None
    return Distill.from_config(config.distillation.distillation_loss)


def teacher_problems(config: Any, tokenizer: Any) -> list[str]:
    """Each teacher's path names a model, and its tokenizer is the student's (the teacher scores the
    student's token ids as they are): one line per problem, before any model loads."""
    from posttrain.models import load_tokenizer
    from posttrain.trainer.preflight import model_path_problem

    problems = []
    where = teacher_entry_names(config)
    trust = config.actor_rollout_ref.model.trust_remote_code
    student_vocab = tokenizer.get_vocab() if tokenizer is not None else None
    for key, teacher in resolve_teachers(config).items():
        prefix = f"{where.get(key, 'distillation.teacher_models')}.model_path"
        path = teacher.model_path
        problem = model_path_problem(path) if path is not None else "is not set"
        if problem is not None:
            problems.append(f"{prefix}={path}: {problem}")
            continue
        try:
            teacher_tokenizer = load_tokenizer(path, trust_remote_code=trust)
        except (OSError, ValueError, KeyError, TypeError) as err:
            problems.append(f"{prefix}={path}: cannot load its tokenizer ({str(err).strip().splitlines()[0]})")
            continue
        if student_vocab is not None and teacher_tokenizer.get_vocab() != student_vocab:
            problems.append(f"{prefix}={path}: its tokenizer is not the student's "
                            f"(actor_rollout_ref.model.path={config.actor_rollout_ref.model.path}); on-policy "
                            "distillation scores the student's token ids, so teacher and student must share one")
    return problems


def prepare(config: Any, tokenizer: Any, data: Any) -> Distill | None:
    """Before any model loads: the teachers' paths and tokenizers, and with several teachers the rows'
    routing (the ``teacher_key`` column is in the training data and each row's value names a teacher).
    Makes the prompt batches carry that column. Raises ConfigError; returns the objective (None: no distillation)."""
    objective = distillation_objective(config)
    if objective is None:
        return None
    problems = teacher_problems(config, tokenizer)
    teachers = resolve_teachers(config)
    key = config.distillation.teacher_key
    if list(teachers) != [SINGLE_TEACHER_KEY]:
        problems += routing_problems(data.train, key, list(teachers))
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else f"{len(problems)} distillation problems:\n"
                          + "\n".join(f"  - {p}" for p in problems))
    if key not in _ITEM_COLUMNS:
        for dataset in (data.train, data.val):
            dataset.extra_columns = tuple(dict.fromkeys((*dataset.extra_columns, key)))
    return objective


def routing_problems(dataset: Any, key: str, teachers: list[str]) -> list[str]:
    """The training rows' ``key`` column against the teachers' keys: one line for a missing column, one for
    the first row whose value names no teacher."""
    files = ", ".join(dataset.files)
    if not any(key in row for row in dataset.rows):
        return [f"distillation.teacher_key={key}: no row of data.train_files ({files}) has that column, which picks "
                f"each row's teacher among {', '.join(sorted(teachers))}"]
    for i, row in enumerate(dataset.rows):
        value = row.get(key)
        if value is None or str(value) not in teachers:
            return [f"data.train_files ({files}) row {i}: its {key} value {value!r} names no teacher "
                    f"(distillation.teacher_models keys: {', '.join(sorted(teachers))})"]
    return []


def score(workers: Any, batch: Batch) -> None:
    """The teachers' scores of ``batch``'s sampled tokens, added to it as columns."""
    log_probs, topk_ids, topk_log_probs = workers.compute_teacher_log_prob(batch)
    batch["teacher_log_probs"] = log_probs
    if topk_ids is not None:
        batch["teacher_topk_ids"], batch["teacher_topk_log_probs"] = topk_ids, topk_log_probs
