"""Run policy around the checkpoint storage (`posttrain.checkpoint`): which checkpoint a run resumes
from (`trainer.resume_mode`), whether it was saved with compatible settings (the fingerprint), what
the driver itself saves besides the workers' state (step, data position, KL controller, counters),
the save on SIGINT/SIGTERM and the final Hugging Face export.

The workers save and load their own state (``WorkerGroup.save_checkpoint(folder)``), so nothing
here touches a model or an optimizer: the same code serves one process and a Ray group of ranks.
"""

from __future__ import annotations

import json
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from posttrain.checkpoint import (CheckpointError, CheckpointManager, checkpoint_problem, is_step_dir_name,
                                  read_run_state, restore_rng)
from posttrain.config import ConfigError

__all__ = ["ResumeError", "RunState", "check_compatible", "config_fingerprint", "export_final", "report_signal_stop",
           "restore_run", "resolve_resume", "save_run"]

logger = logging.getLogger(__name__)

FINGERPRINT_KEY = "config_fingerprint"

# Names the fingerprint keys go by in error messages.
_FINGERPRINT_NAMES = {
    "model_path": "actor_rollout_ref.model.path",
    "adv_estimator": "algorithm.adv_estimator",
    "critic": "critic.enable",  # resolved: null means "only for gae"
    "vocab_size": "model vocab_size",
}

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


# ---------------------------------------------------------------------- which checkpoint
def config_fingerprint(config: Any, vocab_size: int | None = None) -> dict[str, Any]:
    """What must match between the run that saved a checkpoint and the run resuming it."""
    from posttrain.config import uses_critic

    return {"model_path": str(config.actor_rollout_ref.model.path), "adv_estimator": config.algorithm.adv_estimator,
            "critic": uses_critic(config), "vocab_size": vocab_size}


def check_compatible(extra: Mapping[str, Any], current_fingerprint: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose ``extra["config_fingerprint"]`` differs from this run's."""
    saved = extra.get(FINGERPRINT_KEY)
    if saved is None:
        logger.warning("checkpoint has no %s; cannot check it was saved with this config", FINGERPRINT_KEY)
        return
    current = json.loads(json.dumps(dict(current_fingerprint), default=str))  # tuples -> lists, as saved
    differ = [k for k in current if k in saved and saved[k] != current[k]]
    for k in differ:
        if k in _WARN_ONLY:
            logger.warning("checkpoint was saved with %s=%s, this run has %s; resuming anyway",
                           _FINGERPRINT_NAMES.get(k, k), saved[k], current[k])
    mismatches = [f"{_FINGERPRINT_NAMES.get(k, k)}={saved[k]}, this run has {current[k]}"
                  for k in differ if k not in _WARN_ONLY]
    if mismatches:
        raise CheckpointError("checkpoint was saved with " + "; and ".join(mismatches) +
                              ". Resume with the same settings, or start over with trainer.resume_mode=disable "
                              "or another trainer.default_local_dir")


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
        hint = ""
        if path.is_dir():
            latest = CheckpointManager(path).latest()
            hint = f" (its latest is {latest})" if latest else ""
        raise CheckpointError(f"trainer.resume_from_path={raw} must be a global_step_N folder{hint}")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"trainer.resume_from_path={raw}: {problem}")
    return path


# ---------------------------------------------------------------------- save / restore
def save_run(manager: CheckpointManager, workers: Any, run: RunState, train_loader: Any, kl_ctrl: Any,
             fingerprint: dict) -> Path:
    """Each role writes its own folder (``workers.save_checkpoint``); the driver adds its state."""
    extra = {
        "global_step": run.global_step,
        "train_loader": train_loader.state_dict(),
        "kl_ctrl": kl_ctrl.state_dict() if kl_ctrl is not None else None,
        "nonfinite_streak": run.nonfinite_streak,
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
        raise ResumeError(f"{path}: {err} (data.train_batch_size or data.train_files changed?)") from err
    workers.load_checkpoint(path)
    if kl_ctrl is not None and saved.extra.get("kl_ctrl"):
        kl_ctrl.load_state_dict(saved.extra["kl_ctrl"])
    restore_rng(saved.rng)
    run = RunState(int(saved.extra["global_step"]), int(saved.extra.get("nonfinite_streak", 0)))
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
    out = latest.parent / "hf_model"
    export_actor(latest, out)
    print(f"exported the final actor as a Hugging Face folder: {out}", flush=True)
    return out
