"""What the trainer saves and restores: worker states, data-loader position, KL controller, step
counter and RNG states (through `checkpoint.CheckpointManager`, which makes saves atomic)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.config import ConfigError
from posttrain.trainer.checkpoint import (CheckpointError, CheckpointManager, RoleState, check_compatible,
                                          config_fingerprint, resolve_resume, restore_rng)

if TYPE_CHECKING:
    from posttrain.trainer.trainer import RLTrainer


class ResumeError(CheckpointError, ConfigError):
    """The checkpoint to resume from cannot be used with this run's settings (a `CheckpointError`, and a
    `ConfigError` so that the command line prints it as one `error:` line and exits 2)."""


class TrainerCheckpointing:
    def __init__(self, trainer: "RLTrainer"):
        self.trainer = trainer
        cfg = trainer.config.trainer
        self.manager = CheckpointManager(Path(cfg.default_local_dir).expanduser(), cfg.max_actor_ckpt_to_keep,
                                         cfg.max_critic_ckpt_to_keep)
        self._saved_step: int | None = None  # the step this process last saved

    def _fingerprint(self) -> dict:
        return config_fingerprint(self.trainer.config, vocab_size=len(self.trainer.tokenizer))

    def save(self) -> Path:
        t = self.trainer
        actor = t.workers.actor
        roles = {"actor": RoleState.from_worker(actor.state_dict(), hf_config=actor.module.config, tokenizer=t.tokenizer)}
        if t.workers.critic is not None:
            critic = t.workers.critic
            roles["critic"] = RoleState.from_worker(critic.state_dict(), hf_config=critic.module.config)
        extra = {
            "global_step": t.global_step,
            "train_loader": t.data.train_loader.state_dict(),
            "kl_ctrl": t.kl_ctrl.state_dict() if t.kl_ctrl is not None else None,
            "nonfinite_streak": t._nonfinite_streak,
            "config_fingerprint": self._fingerprint(),
        }
        path = self.manager.save(t.global_step, roles, extra)
        self._saved_step = t.global_step
        return path

    def maybe_resume(self) -> bool:
        """Restore the checkpoint `trainer.resume_mode` points to; False when starting fresh."""
        try:
            return self._resume()
        except ResumeError:
            raise
        except (CheckpointError, ValueError) as err:  # ValueError: the prompt loader's own checks
            raise ResumeError(str(err)) from err

    def _resume(self) -> bool:
        t = self.trainer
        path = resolve_resume(_with_expanded_dir(t.config.trainer))
        if path is None:
            return False
        loaded = self.manager.load(path)
        check_compatible(loaded.extra, self._fingerprint())
        if t.workers.critic is not None and "critic" not in loaded.roles:
            raise ResumeError(f"{path} has no critic, but this run trains one (algorithm.adv_estimator=gae)")
        try:
            t.data.train_loader.load_state_dict(loaded.extra["train_loader"])
        except ValueError as err:
            raise ResumeError(f"{path}: {err} (data.train_batch_size or data.train_files changed?)") from err
        t.workers.actor.load_state_dict(loaded.roles["actor"].worker_state())
        if t.workers.critic is not None:
            t.workers.critic.load_state_dict(loaded.roles["critic"].worker_state())
        if t.kl_ctrl is not None and loaded.extra.get("kl_ctrl"):
            t.kl_ctrl.load_state_dict(loaded.extra["kl_ctrl"])
        t.global_step = int(loaded.extra["global_step"])
        t._nonfinite_streak = int(loaded.extra.get("nonfinite_streak", 0))
        restore_rng(loaded.rng)
        print(f"resumed from {path} at step {t.global_step}", flush=True)
        if t.global_step >= t.total_steps:
            print(f"the checkpoint is at step {t.global_step} and this run has {t.total_steps} steps: nothing left to "
                  "train (raise trainer.total_training_steps or trainer.total_epochs to continue)", flush=True)
        return True

    def save_on_signal(self, signum: int) -> None:
        step = self.trainer.global_step
        if self._saved_step == step and self.manager.latest() == self.manager.step_dir(step):
            path = self.manager.step_dir(step)  # trainer.save_freq saved this step a moment ago
        else:
            path = self.save()
        name = signal.Signals(signum).name
        print(f"stopped by {name} after step {self.trainer.global_step}; checkpoint saved to {path}.\n"
              "Resume with the same command (trainer.resume_mode=auto picks the latest checkpoint), or with "
              f"trainer.resume_mode=resume_path trainer.resume_from_path={path}", flush=True)

    def export_final(self) -> Path | None:
        from posttrain.trainer.export import export_actor

        latest = self.manager.latest()
        if latest is None:
            return None
        out = latest.parent / "hf_model"
        export_actor(latest, out)
        print(f"exported the final actor as a Hugging Face folder: {out}", flush=True)
        return out


def _with_expanded_dir(trainer_cfg):
    import copy

    cfg = copy.copy(trainer_cfg)
    cfg.default_local_dir = str(Path(trainer_cfg.default_local_dir).expanduser())
    return cfg
