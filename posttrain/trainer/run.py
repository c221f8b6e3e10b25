"""The run loop every stage shares (RL, SFT, DPO): resume, the steps with their validate/save cadence,
the tracker, SIGINT/SIGTERM, the save on a signal and the final export.

A stage (`Stage`) supplies what differs: ``step()`` (draw the next batch and train on it),
``validate()``, and ``save_checkpoint()`` / ``restore()`` (its own state beside the workers', with its
fingerprint). Under torchrun every process is a rank that runs this loop; the rank rules go through
the worker group: only where ``workers.writes`` does the run log, lock the checkpoint folder, seal a
checkpoint and export, and ``workers.agree_stop`` has the ranks stop after the same step.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Any, Callable, Protocol

from posttrain.errors import SignalStop
from posttrain.rewards.manager import RewardInterrupted, scoring_in_progress
from posttrain.trainer import resume, setup

__all__ = ["RunLoop", "Stage", "StepUndone", "startup_signals"]


class StepUndone(Exception):
    """Raised by `Stage.step` for a step that was rolled back before it changed any weight (a signal
    during scoring, or the data ran out): the run ends at the last finished step. With ``data_ended``
    that step is the run's last, saved and exported as a finished run's."""

    def __init__(self, data_ended: bool = False):
        super().__init__("the step in flight was undone")
        self.data_ended = data_ended


class Stage(Protocol):
    """What the run loop needs of a trainer."""

    config: Any  # its ``trainer`` section: logger, project_name, experiment_name, test_freq, save_freq
    workers: Any  # the worker group: writes, agree_stop, follow_save (non-writing ranks), shutdown
    checkpoints: Any  # posttrain.checkpoint.CheckpointManager
    train_loader: Any  # its ``epoch`` is logged with each step
    total_steps: int
    global_step: int
    history: list[dict[str, float]]
    stopped_by: int | None
    metric_prefix: str  # each step's epoch and global step are logged as <prefix>/epoch, <prefix>/global_step

    def step(self) -> dict[str, float]: ...

    def validate(self) -> dict[str, float]: ...

    def save_checkpoint(self) -> Path: ...

    def restore(self) -> resume.RunState | None: ...


class RunLoop:
    """One run of a stage (`fit`).

    Args:
        stage: the trainer.
        validate_first: validate before the first step (not after a resume), logged at step 0.
        validate_only: end the run after that validation.
        check: called with each step's metrics (validation's included) before the step is saved.
        on_exit: called once the run ends, however it ends, with whether a signal stopped it.
    """

    def __init__(self, stage: Stage, *, validate_first: bool = False, validate_only: bool = False,
                 check: Callable[[dict], None] | None = None, on_exit: Callable[[bool], None] | None = None):
        self.stage, self.validate_first, self.validate_only = stage, validate_first, validate_only
        self.check, self.on_exit = check, on_exit
        self.stop_signal: int | None = None
        self.phase = "start-up"
        self.saved_step: int | None = None  # the step this run last saved

    def fit(self) -> list[dict[str, float]]:
        """Train until ``stage.total_steps``; returns the per-step metrics (also sent to ``trainer.logger``).

        SIGINT/SIGTERM (first one): the step in flight finishes, a checkpoint is saved and ``fit``
        returns with ``stage.stopped_by`` set to the signal; a signal that arrives while rewards are
        being computed stops at once and saves the last finished step. A second one aborts without saving.
        """
        from posttrain.tracking import Tracking

        s, cfg = self.stage, self.stage.config.trainer
        tracker = Tracking(cfg.logger if s.workers.writes else [], setup.run_dir(s.config), cfg.project_name,
                           cfg.experiment_name, config_dict(s.config), s.total_steps)
        try:
            with _StopOnSignals(self):
                self.phase = "resume"
                self._restore()
                if self.validate_first and s.global_step == 0 and not self._validate_first(tracker):
                    tracker.finish()
                    return s.history
                self.phase = "train"
                self._train(tracker)
        finally:
            s.workers.shutdown()  # a failed rank must not leave the others waiting in a collective
            if self.on_exit is not None:
                self.on_exit(self.stop_signal is not None)
            if s.workers.writes:
                s.checkpoints.unlock()  # the folder's lock (one writer) ends with the run
        if cfg.save_freq > 0 and s.global_step == s.total_steps and s.stopped_by is None and s.workers.writes:
            resume.export_final(s.checkpoints)
        tracker.finish()
        return s.history

    def _restore(self) -> None:
        s = self.stage
        run = s.restore()
        if run is None:
            return
        s.global_step = run.global_step
        if s.global_step >= s.total_steps:
            print(f"the checkpoint is at step {s.global_step} and this run has {s.total_steps} steps: nothing "
                  "left to train (raise trainer.total_training_steps or trainer.total_epochs to continue)", flush=True)

    def _validate_first(self, tracker: Any) -> bool:
        """The validation before training; False when the run ends there."""
        s = self.stage
        self.phase = "validation"
        try:
            val = s.validate()
        except RewardInterrupted:
            val = None
        if val is not None:
            s.history.append({"step": 0, **val})
            tracker.log(val, step=0)
        if not self.validate_only and self.stop_signal is None:
            return True
        s.stopped_by = self.stop_signal
        if s.stopped_by is not None:
            print(f"stopped by {signal.Signals(s.stopped_by).name} before the first step: nothing was trained, so "
                  "nothing was saved", flush=True)
        return False

    def _train(self, tracker: Any) -> None:
        s, cfg = self.stage, self.stage.config.trainer
        while s.global_step < s.total_steps and not self._stopping():
            s.global_step += 1
            epoch = s.train_loader.epoch  # of the batch drawn next (the loader then moves on)
            try:
                metrics = s.step()
            except StepUndone as undone:
                s.global_step -= 1
                if undone.data_ended:
                    self._end_with_the_data()
                break
            metrics.update({f"{s.metric_prefix}/epoch": epoch, f"{s.metric_prefix}/global_step": s.global_step})
            last = s.global_step == s.total_steps
            if cfg.test_freq > 0 and (s.global_step % cfg.test_freq == 0 or last) and not self._stopping():
                try:
                    metrics.update(s.validate())
                except RewardInterrupted:
                    print("validation interrupted; saving the step without its validation metrics", flush=True)
            if self.check is not None:
                self.check(metrics)
            if cfg.save_freq > 0 and (s.global_step % cfg.save_freq == 0 or last):
                self._save()
            tracker.log(metrics, step=s.global_step)
            s.history.append({"step": s.global_step, **metrics})
        if self.stop_signal is not None:
            s.stopped_by = self.stop_signal
            self._save_on_signal()

    def _stopping(self) -> bool:
        """A signal arrived here or, under torchrun, on another rank (then the ranks stop together)."""
        if self.stage.workers.agree_stop(self.stop_signal is not None) and self.stop_signal is None:
            self.stop_signal = signal.SIGTERM
        return self.stop_signal is not None

    def _save(self) -> Path:
        """A writer saves; under torchrun the other ranks write their shards where it says."""
        s = self.stage
        if s.workers.writes:
            path = s.save_checkpoint()
        else:
            s.workers.follow_save()
            path = s.checkpoints.step_dir(s.global_step)
        self.saved_step = s.global_step
        return path

    def _end_with_the_data(self) -> None:
        """The last finished step is the run's last (saved, when trainer.save_freq saves, and exported)."""
        s = self.stage
        s.total_steps = s.global_step
        if s.config.trainer.save_freq > 0 and s.global_step > 0 and self.saved_step != s.global_step:
            self._save()

    def _save_on_signal(self) -> None:
        step, signum = self.stage.global_step, self.stop_signal
        if step == 0:
            print(f"stopped by {signal.Signals(signum).name} before the first step finished: nothing was trained, "
                  "so nothing was saved", flush=True)
            return
        # trainer.save_freq may have saved this step a moment ago
        path = self.stage.checkpoints.step_dir(step) if self.saved_step == step else self._save()
        resume.report_signal_stop(signum, step, path)


def config_dict(config: Any) -> dict:
    """The whole config as plain containers, for the tracker."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True)  # type: ignore[return-value]


class _StopOnSignals:
    """SIGINT/SIGTERM: let the current step finish, then save and stop; a second Ctrl-C aborts at once.

    While rewards are being computed (a scorer may hang for up to ``reward.timeout_s``) the first
    signal stops at once: the handler raises `RewardInterrupted`, the step is undone (no weights had
    changed yet) and the last finished step is saved."""

    def __init__(self, loop: RunLoop):
        self.loop, self.previous = loop, {}

    def _handler(self, signum, frame):
        loop = self.loop
        if loop.stop_signal is not None:
            raise KeyboardInterrupt
        loop.stop_signal = signum
        step = loop.stage.global_step
        if loop.phase == "validation":
            what = "stopping the validation before training; nothing is trained yet, so nothing will be saved"
        elif loop.phase == "resume":
            what = "finishing loading the checkpoint, then stopping without training"
        elif scoring_in_progress():
            what = (f"stopping the reward computation of step {step} now, then saving a checkpoint of the last "
                    "finished step")
        else:
            what = f"finishing step {step}, then saving a checkpoint and stopping"
        print(f"\nreceived {signal.Signals(signum).name}: {what} (press Ctrl-C again to abort now, without saving)",
              flush=True)
        if scoring_in_progress():
            raise RewardInterrupted(signum)

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        return False


@contextlib.contextmanager
def startup_signals():
    """While a run is being built (tokenizer, data, models): the first SIGINT/SIGTERM says that nothing
    has been trained or saved and stops (`SignalStop`, exit 128 + the signal)."""

    def handler(signum, frame):
        name = signal.Signals(signum).name
        print(f"\nreceived {name} during start-up: nothing has been trained yet, so there is nothing to save; "
              "stopping now", flush=True)
        raise SignalStop(f"stopped by {name} during start-up", signum)

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread
            pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
