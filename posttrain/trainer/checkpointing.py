"""What the trainer saves and restores: worker states, data-loader position, KL controller, step
counter and RNG states (through `checkpoint.CheckpointManager`, which makes saves atomic)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.trainer.checkpoint import (CheckpointManager, RoleState, check_compatible, config_fingerprint,
                                          resolve_resume, restore_rng)

if TYPE_CHECKING:
    from posttrain.trainer.trainer import RLTrainer


class TrainerCheckpointing:
    def __init__(self, trainer: "RLTrainer"):
        self.trainer = trainer
        cfg = trainer.config.trainer
        self.manager = CheckpointManager(Path(cfg.default_local_dir).expanduser(), cfg.max_actor_ckpt_to_keep,
                                         cfg.max_critic_ckpt_to_keep)

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
        return self.manager.save(t.global_step, roles, extra)

    def maybe_resume(self) -> bool:
        """Restore the checkpoint `trainer.resume_mode` points to; False when starting fresh."""
        t = self.trainer
        path = resolve_resume(_with_expanded_dir(t.config.trainer))
        if path is None:
            return False
        loaded = self.manager.load(path)
        check_compatible(loaded.extra, self._fingerprint())
        t.workers.actor.load_state_dict(loaded.roles["actor"].worker_state())
        if t.workers.critic is not None:
            if "critic" not in loaded.roles:
                from posttrain.trainer.checkpoint import CheckpointError

                raise CheckpointError(f"{path} has no critic, but this run trains one (algorithm.adv_estimator=gae)")
            t.workers.critic.load_state_dict(loaded.roles["critic"].worker_state())
        t.data.train_loader.load_state_dict(loaded.extra["train_loader"])
        if t.kl_ctrl is not None and loaded.extra.get("kl_ctrl"):
            t.kl_ctrl.load_state_dict(loaded.extra["kl_ctrl"])
        t.global_step = int(loaded.extra["global_step"])
        t._nonfinite_streak = int(loaded.extra.get("nonfinite_streak", 0))
        restore_rng(loaded.rng)
        print(f"resumed from {path} at step {t.global_step}", flush=True)
        return True

    def save_on_signal(self, signum: int) -> None:
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
