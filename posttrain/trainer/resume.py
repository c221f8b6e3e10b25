"""Run policy around the checkpoint storage (`posttrain.checkpoint`): which checkpoint a run resumes
from (`trainer.resume_mode`), whether it was saved with compatible settings (the fingerprint), what
the driver itself saves besides the workers' state (step, data position, KL controller, counters),
the save on SIGINT/SIGTERM and the final Hugging Face export.

The workers save and load their own state (``WorkerGroup.save_checkpoint(folder)``), so nothing
here touches a model or an optimizer: the same code serves one process and a Ray group of ranks.
Each rank saves and restores its own random state (``rng/rank_<r>.pt``); a resume at another world
size says on the console which ranks continue their saved state and which are reseeded, with which
seeds (`posttrain.checkpoint.rank_rng`).
"""

from __future__ import annotations

import json
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from posttrain.checkpoint import (EXTRA_FILE, CheckpointError, CheckpointManager, checkpoint_problem,
                                  is_step_dir_name, read_run_state, restore_rng)
from posttrain.checkpoint.rank_rng import describe_rank_rng_plan, rank_rng_plan, saved_rank_count
from posttrain.config import ConfigError

__all__ = ["ResumeError", "RunFinished", "RunState", "changed_settings", "check_compatible", "check_folder_owner",
           "config_fingerprint", "export_final", "identity_mismatches", "mark_finished", "prepare_folder",
           "read_finished", "report_signal_stop", "restore_run", "resolve_resume", "save_run"]

logger = logging.getLogger(__name__)

FINGERPRINT_KEY = "config_fingerprint"
FIRST_VALIDATION_KEY = "first_validation"  # in extra_state.json: the step-0 validation's metrics
FINISHED_FILE = "finished_run.json"  # in trainer.default_local_dir: the run that finished there (`mark_finished`)
HF_MODEL = "hf_model"  # the finished run's export, beside its checkpoints

# Names the fingerprint keys go by in error messages.
_FINGERPRINT_NAMES = {
    "model_path": "actor_rollout_ref.model.path",
    "adv_estimator": "algorithm.adv_estimator",
    "critic": "critic.enable",  # resolved: null means "only for gae"
    "vocab_size": "model vocab_size",
    "lora": "LoRA settings (lora_rank, lora_alpha, target_modules, exclude_modules, lora_adapter_path)",
    "async_rollouts": "asynchronous rollouts (actor_rollout_ref.hybrid_engine=False, trainer.v1.trainer_mode)",
}

# Settings that may change between a run and its resume, but change what the resumed run does: a
# resume with other values says so at start-up, naming the keys.
SETTING_KEYS = (
    "actor_rollout_ref.actor.optim.lr", "critic.optim.lr", "data.train_batch_size", "data.max_prompt_length",
    "data.max_response_length", "actor_rollout_ref.rollout.n", "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.actor.clip_ratio_low", "actor_rollout_ref.actor.clip_ratio_high",
    "actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.actor.loss_agg_mode", "actor_rollout_ref.actor.policy_loss.loss_mode",
    "actor_rollout_ref.rollout.temperature", "algorithm.use_kl_in_reward", "algorithm.kl_ctrl.kl_coef",
    "algorithm.norm_adv_by_std_in_grpo", "critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu",
    "data.train_files", "trainer.total_training_steps", "trainer.total_epochs", "trainer.seed",
    "data.gen_batch_size", "algorithm.filter_groups.enable", "algorithm.filter_groups.metric",
    "algorithm.filter_groups.max_num_gen_batches", "reward_model.reward_manager", "reward_model.overlong_buffer.enable",
    "reward_model.overlong_buffer.len", "reward_model.overlong_buffer.penalty_factor",
)
SETTINGS = "settings"

# A moved or re-downloaded model folder is the same model: the vocabulary size and the strict weight
# loads catch a different one, so a changed path only warns.
_WARN_ONLY = {"model_path"}


class ResumeError(CheckpointError, ConfigError):
    """The checkpoint to resume from cannot be used with this run's settings (a `CheckpointError`, and a
    `ConfigError` so that the command line prints it as one `error:` line and exits 2)."""


@dataclass
class RunState:
    """What the driver saves besides the workers' state."""

    global_step: int
    nonfinite_streak: int = 0
    first_validation: dict[str, float] | None = None
    """The validation before the first step (step 0), kept across resumes: a resumed run's gain is measured from it."""


# ---------------------------------------------------------------------- which checkpoint
def config_fingerprint(config: Any, vocab_size: int | None = None) -> dict[str, Any]:
    """What must match between the run that saved a checkpoint and the run resuming it."""
    from posttrain.config import uses_critic

    from posttrain.config.validate import get_key

    settings = {key: get_key(config, key) for key in SETTING_KEYS}
    return {"model_path": str(config.actor_rollout_ref.model.path), "adv_estimator": config.algorithm.adv_estimator,
            "critic": uses_critic(config), "vocab_size": vocab_size, **_lora_fingerprint(config),
            "async_rollouts": not config.actor_rollout_ref.hybrid_engine,
            SETTINGS: json.loads(json.dumps(settings, default=str))}


def _lora_fingerprint(config: Any) -> dict[str, Any]:
    """``{"lora": each role's LoRA settings}``, or nothing for full fine-tuning (``check_compatible`` reads
    an absent entry as full fine-tuning). A checkpoint holds only the adapters, so they must be the same
    adapters; the base weights themselves are checked by digest when a role loads."""
    from posttrain.config import uses_critic
    from posttrain.models.lora import lora_settings

    actor = lora_settings(config.actor_rollout_ref.model, "actor_rollout_ref.model")
    critic = lora_settings(config.critic.model, "critic.model") if uses_critic(config) else None
    if actor is None and critic is None:
        return {}
    return {"lora": {"actor": actor.as_dict() if actor else None, "critic": critic.as_dict() if critic else None}}


def check_compatible(extra: Mapping[str, Any], current_fingerprint: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose ``extra["config_fingerprint"]`` differs from this run's."""
    saved = extra.get(FINGERPRINT_KEY)
    if saved is None:
        logger.warning("checkpoint has no %s; cannot check it was saved with this config", FINGERPRINT_KEY)
        return
    current = _as_saved(current_fingerprint)
    _report_changed_settings(saved.get(SETTINGS) or {}, current.get(SETTINGS) or {})
    for k in _differing_keys(saved, current):
        if k in _WARN_ONLY:
            logger.warning("checkpoint was saved with %s=%s, this run has %s; resuming anyway",
                           _FINGERPRINT_NAMES.get(k, k), saved[k], current[k])
    mismatches = identity_mismatches(saved, current)
    if mismatches:
        raise CheckpointError("checkpoint was saved with " + "; and ".join(mismatches) +
                              ". Resume with the same settings, or start over with trainer.start_over=True (moves "
                              "the checkpoints aside) or another trainer.default_local_dir")


def _as_saved(fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(dict(fingerprint), default=str))  # tuples -> lists, as saved


def _differing_keys(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The fingerprint keys (settings aside) whose values differ; a value this run does not know yet (None:
    the vocabulary before the tokenizer loads) is not compared."""
    differ = [k for k in current if k != SETTINGS and k in saved and current[k] is not None and saved[k] != current[k]]
    if "lora" not in differ and saved.get("lora") != current.get("lora"):  # absent: full fine-tuning
        differ.append("lora")
    return differ


def identity_mismatches(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``key=saved, this run has value`` for each fingerprint key that makes the saved run another run
    (model, algorithm, critic, LoRA, asynchronous rollouts; a moved model folder only warns)."""
    return [f"{_FINGERPRINT_NAMES.get(k, k)}={saved.get(k)}, this run has {current.get(k)}"
            for k in _differing_keys(saved, current) if k not in _WARN_ONLY]


def changed_settings(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``key: saved -> this run's`` for each of `SETTING_KEYS` that differs between two fingerprints."""
    before, now = saved.get(SETTINGS) or {}, _as_saved(current).get(SETTINGS) or {}
    return [f"{k}: {before[k]!r} -> {now[k]!r}" for k in now if k in before and before[k] != now[k]]


def _report_changed_settings(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    changed = [f"{k}: {saved[k]!r} -> {current[k]!r}" for k in current if k in saved and saved[k] != current[k]]
    if changed:
        print("note: resuming with settings that differ from the run that saved the checkpoint:\n  "
              + "\n  ".join(changed), flush=True)
    return changed


# ---------------------------------------------------------------------- the folder
def prepare_folder(trainer_config: Any, manager: CheckpointManager, fingerprint: Mapping[str, Any] | None = None) -> None:
    """The checkpoint folder's rule, applied at start-up (before any model loads), with the folder locked:

    - it holds no results (no ``global_step_N``, no finished run, no ``hf_model/``): nothing to decide;
    - ``trainer.start_over=True``: its checkpoints (and tracker, ``hf_model/``, the finished run's record) move
      to ``previous_run_<time>/`` inside it, and this run starts at step 0;
    - given this run's ``fingerprint``: another run's results are refused, and so is this run once it
      finished (`check_folder_owner`);
    - ``resume_mode=disable``: refused (this run's steps would mix with the other run's, and pruning
      or a later resume would pick the wrong ones); the same for ``resume_mode=resume_path`` from a
      checkpoint outside the folder;
    - ``resume_mode=auto`` and no checkpoint is complete: refused, listing what is wrong with each;
    - otherwise resume as ``resume_mode`` says;

    and, given ``fingerprint``, a ``resume_mode=resume_path`` checkpoint of another run (model, algorithm, critic,
    LoRA, rollout mode) is refused, wherever it is (`check_named_checkpoint`).
    """
    trainer = getattr(trainer_config, "trainer", trainer_config)
    _apply_folder_rule(trainer, manager, fingerprint)
    if fingerprint is not None and trainer.resume_mode == "resume_path" and not trainer.start_over:
        check_named_checkpoint(trainer, fingerprint)


def check_named_checkpoint(trainer: Any, fingerprint: Mapping[str, Any]) -> None:
    """``trainer.resume_from_path`` saved by another run: refused before any model loads, naming what differs (the
    resume's own `check_compatible` would find it only once the models are built). A path that is not a complete
    checkpoint is left to `resolve_resume`, which names what is wrong with it."""
    raw = trainer.resume_from_path
    path = Path(raw).expanduser().absolute() if raw else None
    if path is None or not is_step_dir_name(path.name) or not (path / EXTRA_FILE).is_file():
        return
    try:
        mismatches = _saved_with_other(path, fingerprint)
    except ResumeError:
        return  # resolve_resume's checkpoint_problem names the unreadable file
    if mismatches:
        raise ResumeError(f"trainer.resume_from_path={raw} is another run's checkpoint: it was saved with "
                          + "; ".join(mismatches) + ". Resume a checkpoint saved with this run's settings, or drop "
                          "trainer.resume_mode=resume_path to start at step 0")


def _apply_folder_rule(trainer: Any, manager: CheckpointManager, fingerprint: Mapping[str, Any] | None) -> None:
    """`prepare_folder`'s rule for what ``trainer.default_local_dir`` holds."""
    steps, root = manager.step_dirs(), manager.root
    if not steps and not (root / FINISHED_FILE).exists() and not (root / HF_MODEL).exists():
        return
    if trainer.start_over:
        _move_aside(root, steps)
        return
    if fingerprint is not None:
        check_folder_owner(trainer, manager, fingerprint)
    if not steps:
        return
    listed = ", ".join(p.name for p in steps[-4:]) + (f" (and {len(steps) - 4} more)" if len(steps) > 4 else "")
    fixes = (f"resume it (trainer.resume_mode=auto), use another trainer.default_local_dir, or set trainer.start_over=True "
             f"to move its checkpoints to {root}/previous_run_<time>/ and start at step 0")
    if trainer.resume_mode == "disable":
        raise ResumeError(f"trainer.resume_mode=disable, but trainer.default_local_dir={root} holds another run's "
                          f"checkpoints ({listed}); starting over there would mix the two runs: {fixes}")
    if trainer.resume_mode == "resume_path" and trainer.resume_from_path:
        source = Path(trainer.resume_from_path).expanduser().absolute()
        given_root = _checkpoint_root_given(trainer.resume_from_path, source)
        if given_root:
            raise ResumeError(given_root)
        if source.parent.resolve() != root.resolve():
            raise ResumeError(f"trainer.resume_from_path={trainer.resume_from_path} is outside "
                              f"trainer.default_local_dir={root}, which holds another run's checkpoints ({listed}); "
                              f"this run's steps would mix with them: {fixes.replace('resume it (trainer.resume_mode=auto), ', '')}")
    if trainer.resume_mode == "auto":
        problems = [checkpoint_problem(p) for p in steps]
        if all(problems):
            raise ResumeError(f"trainer.default_local_dir={root} holds checkpoints but none is complete:\n  "
                              + "\n  ".join(problems[-4:]) + f"\nNothing can be resumed; {fixes.replace('resume it (trainer.resume_mode=auto), ', '')}")


def _move_aside(root: Path, steps: list[Path]) -> Path:
    import os
    import time

    dest = root / f"previous_run_{time.strftime('%Y%m%d-%H%M%S')}"
    n = 0
    while dest.exists():
        n += 1
        dest = root / f"previous_run_{time.strftime('%Y%m%d-%H%M%S')}_{n}"
    dest.mkdir()
    from posttrain.checkpoint import TRACKER

    for path in [*steps, root / TRACKER, root / HF_MODEL, root / FINISHED_FILE]:
        if path.exists():
            os.replace(path, dest / path.name)
    print(f"trainer.start_over=True: moved the earlier run's checkpoints and model found in {root} to {dest}; "
          "starting at step 0", flush=True)
    return dest


# ---------------------------------------------------------------------- whose results the folder holds
class RunFinished(ResumeError):
    """The run in ``trainer.default_local_dir`` finished with this very config: nothing is left to train
    (raised before any model loads); the message says where its model is and how to start it fresh. The
    command line prints it as one line and exits 0: the model the command asked for exists, so a pipeline
    started again after a later stage failed goes on (``set -e`` scripts, `posttrain compare`)."""


def mark_finished(root: Path, step: int, fingerprint: Mapping[str, Any], model_dir: Path | None) -> None:
    """Record in ``root`` that the run finished at ``step``, with its fingerprint and model folder (None: not
    kept), so that starting it again says so instead of training it again (`check_folder_owner`)."""
    import os

    record = {"step": int(step), "model": model_dir.name if model_dir is not None else None,
              FINGERPRINT_KEY: _as_saved(fingerprint)}
    tmp = root / f".tmp_{FINISHED_FILE}_{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, root / FINISHED_FILE)


def read_finished(root: Path) -> dict[str, Any] | None:
    """The record `mark_finished` wrote in ``root``, or None when no run finished there."""
    path = root / FINISHED_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        int(record["step"])
        return record
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ResumeError(f"{path}: cannot read the finished run's record ({err}); set trainer.start_over=True to "
                          f"move it aside with that run's results, or use another trainer.default_local_dir") from None


def check_folder_owner(trainer: Any, manager: CheckpointManager, fingerprint: Mapping[str, Any]) -> None:
    """Whose results ``trainer.default_local_dir`` holds, decided before any model loads:

    - another run's (its finished record or the checkpoint to resume names another model, algorithm,
      critic, LoRA or rollout mode; a finished run with other settings and no checkpoint of its last step to
      go on from; an ``hf_model/`` with no record of its run): refused, saying what differs;
    - this run, finished with the same fingerprint, settings included: refused (`RunFinished`);
    - this run, finished with other settings (more steps, say) and its last step's checkpoint kept: it goes
      on from there (or from a later checkpoint of an earlier try), and its end replaces the record;
    - this run, interrupted: resumed (``resume_mode=resume_path`` too: the user named the checkpoint).
    """
    root, finished = manager.root, read_finished(manager.root)
    if finished is None:
        _check_checkpoint_owner(trainer, manager, fingerprint)
        return
    saved, step = finished.get(FINGERPRINT_KEY) or {}, int(finished["step"])
    mismatches = identity_mismatches(saved, _as_saved(fingerprint))
    if mismatches:
        raise ResumeError(_another_run(root, f"the run that finished there at step {step} had", mismatches))
    if trainer.resume_mode == "resume_path":
        return
    changed = changed_settings(saved, fingerprint)
    latest = manager.latest()  # the last step's checkpoint, or a later one of a run going on from it
    last_kept = latest is not None and int(_extra_state(latest).get("global_step", -1)) >= step
    if not changed:
        raise RunFinished(_finished_message(root, step, finished.get("model"), last_kept))
    if last_kept:  # with resume_mode=disable, `prepare_folder` refuses to mix this run with those checkpoints
        if trainer.resume_mode == "auto":
            print(f"note: the run in {root} finished at step {step}; going on from its checkpoint {latest.name} with "
                  "other settings", flush=True)
        return
    raise ResumeError(_another_run(root, f"the run that finished there at step {step} (and kept no checkpoint of its "
                                         "last step to go on from) had other settings:", changed))


def _check_checkpoint_owner(trainer: Any, manager: CheckpointManager, fingerprint: Mapping[str, Any]) -> None:
    """No run finished in the folder: the checkpoint ``resume_mode=auto`` would resume must be this run's, and
    an ``hf_model/`` without any checkpoint or record is a model this run would overwrite unasked."""
    root = manager.root
    latest = manager.latest() if trainer.resume_mode == "auto" else None
    if latest is None:
        if (root / HF_MODEL).exists() and not manager.step_dirs():
            raise ResumeError(f"trainer.default_local_dir={root} holds {HF_MODEL}/, the model of an earlier run that "
                              "left no record of its config (this run would replace it): point "
                              f"trainer.default_local_dir at a fresh folder, or set trainer.start_over=True to move it to "
                              f"{root}/previous_run_<time>/")
        return
    mismatches = _saved_with_other(latest, fingerprint)
    if mismatches:
        raise ResumeError(_another_run(root, f"its checkpoint {latest.name} was saved with", mismatches))


def _saved_with_other(step_dir: Path, fingerprint: Mapping[str, Any]) -> list[str]:
    """How the run that saved ``step_dir`` differs from this one (model, algorithm, critic, LoRA, rollout mode); empty
    when it is the same run or saved no fingerprint."""
    saved = _extra_state(step_dir).get(FINGERPRINT_KEY)
    return identity_mismatches(saved, _as_saved(fingerprint)) if saved else []


def _extra_state(step_dir: Path) -> dict[str, Any]:
    """A complete checkpoint's driver state, read without hashing its weights (the resume verifies them)."""
    try:
        return json.loads((step_dir / EXTRA_FILE).read_text())
    except (OSError, ValueError) as err:
        raise ResumeError(f"cannot read {step_dir / EXTRA_FILE}: {err}") from err


def _another_run(root: Path, what: str, differences: list[str]) -> str:
    return (f"trainer.default_local_dir={root} holds another run's results: {what} " + "; ".join(differences)
            + f". Point trainer.default_local_dir at a fresh folder, or set trainer.start_over=True to move them to "
            f"{root}/previous_run_<time>/ and start at step 0")


def _finished_message(root: Path, step: int, model: str | None, last_kept: bool) -> str:
    kept = f"its model: {root / model}" if model else "its model was not kept"
    further = ("; to train on from its last checkpoint, raise trainer.total_training_steps or trainer.total_epochs"
               if last_kept else "")
    return (f"this run already finished in trainer.default_local_dir={root} (step {step}, {kept}): nothing left to "
            f"train. To train it again from the start, set trainer.start_over=True (moves it to "
            f"{root}/previous_run_<time>/) or point trainer.default_local_dir at a fresh folder{further}")


def resolve_resume(trainer_config: Any) -> Path | None:
    """verl's ``trainer.resume_mode``: auto (latest complete checkpoint or None), disable, resume_path."""
    trainer = getattr(trainer_config, "trainer", trainer_config)  # accepts the whole config too
    mode = trainer.resume_mode
    if mode == "disable":
        return None
    if mode == "auto":
        return CheckpointManager(Path(trainer.default_local_dir).expanduser()).latest()
    if mode != "resume_path":
        raise CheckpointError(f"trainer.resume_mode={mode!r}: valid modes are auto, disable, resume_path")
    raw = trainer.resume_from_path
    if not raw:
        raise CheckpointError("trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N folder)")
    path = Path(raw).expanduser().absolute()
    if not is_step_dir_name(path.name):
        raise CheckpointError(_checkpoint_root_given(raw, path)
                              or f"trainer.resume_from_path={raw} must be a global_step_N folder")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"trainer.resume_from_path={raw}: {problem}")
    return path


def _checkpoint_root_given(raw: str, path: Path) -> str | None:
    """The error for a ``trainer.resume_from_path`` that is a checkpoint root (the folder holding the
    global_step_N folders) rather than one checkpoint, naming the one to use; None for any other path."""
    if is_step_dir_name(path.name) or not path.is_dir():
        return None
    manager = CheckpointManager(path)
    steps = manager.step_dirs()
    if not steps:
        return None
    latest = manager.latest()
    held = ", ".join(p.name for p in steps[-3:]) + (" ..." if len(steps) > 3 else "")
    use = (f"set trainer.resume_from_path={latest} (its latest complete checkpoint)" if latest is not None else
           f"none of them is complete ({checkpoint_problem(steps[-1])}), so there is nothing to resume there;")
    return (f"trainer.resume_from_path={raw} is the checkpoint root (the folder holding {held}), not one "
            f"checkpoint: {use} or resume the latest with trainer.resume_mode=auto "
            f"trainer.default_local_dir={path}")


# ---------------------------------------------------------------------- save / restore
def save_run(manager: CheckpointManager, workers: Any, run: RunState, train_loader: Any, kl_ctrl: Any,
             fingerprint: dict) -> Path:
    """Each role writes its own folder (``workers.save_checkpoint``); the driver adds its state."""
    extra = {
        "global_step": run.global_step,
        "train_loader": train_loader.state_dict(),
        "kl_ctrl": kl_ctrl.state_dict() if kl_ctrl is not None else None,
        "nonfinite_streak": run.nonfinite_streak,
        FIRST_VALIDATION_KEY: run.first_validation,
        FINGERPRINT_KEY: fingerprint,
    }
    return manager.save(run.global_step, workers.save_checkpoint, extra)


def restore_run(trainer_config: Any, workers: Any, train_loader: Any, kl_ctrl: Any,
                fingerprint: dict) -> RunState | None:
    """Restore the checkpoint ``trainer.resume_mode`` points to; None when starting fresh."""
    try:
        return _restore(trainer_config, workers, train_loader, kl_ctrl, fingerprint)
    except ResumeError:
        raise
    except (CheckpointError, ValueError) as err:  # ValueError: the prompt loader's own checks
        raise ResumeError(str(err)) from err


def _restore(trainer_config, workers, train_loader, kl_ctrl, fingerprint) -> RunState | None:
    path = resolve_resume(trainer_config)
    if path is None:
        return None
    saved = read_run_state(path)
    check_compatible(saved.extra, fingerprint)
    if workers.has_critic and "critic" not in saved.roles:
        raise ResumeError(f"{path} has no critic, but this run trains one (algorithm.adv_estimator=gae)")
    try:
        train_loader.load_state_dict(saved.extra["train_loader"])
    except ValueError as err:
        raise ResumeError(f"{path}: {err} (data.train_batch_size, data.gen_batch_size or data.train_files "
                          "changed?)") from err
    plan = rank_rng_plan(saved_rank_count(path), workers.world_size)
    # The driver's generators first, then each rank's own (in one process the driver is rank 0: its
    # saved rank state is the one that holds; see posttrain.checkpoint.rank_rng).
    restore_rng(saved.rng)
    workers.load_checkpoint(path)
    if kl_ctrl is not None and saved.extra.get("kl_ctrl"):
        kl_ctrl.load_state_dict(saved.extra["kl_ctrl"])
    run = RunState(int(saved.extra["global_step"]), int(saved.extra.get("nonfinite_streak", 0)),
                   saved.extra.get(FIRST_VALIDATION_KEY))
    change = describe_rank_rng_plan(plan, workers.seed, saved.step)
    if change:
        print(change, flush=True)
    print(f"resumed from {path} at step {run.global_step}", flush=True)
    return run


def report_signal_stop(signum: int, step: int, path: Path) -> None:
    print(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint saved to {path}.\n"
          "Resume with the same command (trainer.resume_mode=auto picks the latest checkpoint), or with "
          f"trainer.resume_mode=resume_path trainer.resume_from_path={path}", flush=True)


def export_final(manager: CheckpointManager) -> Path | None:
    """The latest checkpoint's actor as a Hugging Face folder ``hf_model/`` beside the checkpoints."""
    from posttrain.trainer.export import export_actor

    latest = manager.latest()
    if latest is None:
        return None
    out = latest.parent / HF_MODEL
    export_actor(latest, out)
    print(f"exported the final actor as a Hugging Face folder: {out}", flush=True)
    return out
