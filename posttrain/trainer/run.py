"""The run loop every stage shares (RL, SFT, DPO): resume, the steps with their validate/save cadence,
the tracker, SIGINT/SIGTERM, the save on a signal, the stop on non-finite steps and the final export.

A stage (`Stage`) supplies what differs: ``step()`` (draw the next batch and train on it),
``validate()``, and ``save_checkpoint()`` / ``restore()`` (its own state beside the workers', with its
fingerprint). A stage whose ``saves_last_step`` is True (SFT, DPO: verl's SFT trainer) validates and
saves at its last step whatever ``trainer.test_freq`` / ``trainer.save_freq`` say; an RL run saves there
when ``trainer.save_freq`` saves, and with ``trainer.export_at_end`` (the built-in run) exports its final
actor even when it keeps no checkpoint. Every finished run ends with one line naming its model folder
(``hf_model/``) and how to use it, or saying that nothing was kept and which key keeps it, and leaves a
record (`resume.mark_finished`): the same run started again says it finished instead of training again,
and the checkpoints its ``trainer.save_freq`` would not have kept (saved on a signal) go once the model
is exported. Under torchrun every process is a rank that runs this loop; the rank rules go through
the worker group: only where ``workers.writes`` does the run log, lock the checkpoint folder, seal a
checkpoint and export, and ``workers.agree_stop`` has the ranks stop after the same step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from posttrain.errors import PosttrainError, SignalStop
from posttrain.host.process_tree import run_peak_metrics
from posttrain.rewards.manager import RewardInterrupted, scoring_in_progress
from posttrain.trainer import resume, setup

__all__ = ["NonFiniteError", "NonFiniteGuard", "RunLoop", "Stage", "StepUndone", "startup_signals"]

HF_MODEL = resume.HF_MODEL  # the final export, beside the checkpoints in trainer.default_local_dir
REPEAT_WINDOW_S = 1.0  # a second SIGINT/SIGTERM this soon after the first is the same request (not "abort")


class NonFiniteError(PosttrainError, RuntimeError):
    """Several steps in a row produced non-finite losses or gradients, or the final weights are not finite."""

    exit_code = 3


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
    first_validation: dict[str, float] | None  # step 0's validation, set by the run loop and kept in checkpoints
    stopped_by: int | None
    metric_prefix: str  # each step's epoch and global step are logged as <prefix>/epoch, <prefix>/global_step

    def step(self) -> dict[str, float]: ...

    def validate(self) -> dict[str, float]: ...

    def save_checkpoint(self) -> Path: ...

    def restore(self) -> resume.RunState | None: ...

    def fingerprint(self) -> dict: ...


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
        self.model_dir: Path | None = None  # the exported hf_model/ of a finished run
        self.resumed_step: int | None = None  # the step of the checkpoint this run resumed from

    def fit(self) -> list[dict[str, float]]:
        """Train until ``stage.total_steps``; returns the per-step metrics (also sent to ``trainer.logger``).

        SIGINT/SIGTERM (first one): the step in flight finishes, a checkpoint is saved and ``fit``
        returns with ``stage.stopped_by`` set to the signal; a signal that arrives while rewards are
        being computed stops at once and saves the last finished step. A second one aborts without saving
        (one within `REPEAT_WINDOW_S` of the first is that first one, delivered twice).
        """
        from posttrain.tracking import Tracking

        s, cfg = self.stage, self.stage.config.trainer
        scratch = None
        try:
            with _StopOnSignals(self):
                self.phase = "resume"
                self._restore()
                if s.global_step == 0 and s.workers.writes:
                    _set_aside_earlier_results(setup.run_dir(s.config), getattr(s, "rollout_dumps", None))
                # made once the earlier results are aside: tensorboard opens its event file in the run folder
                tracker = Tracking(cfg.logger if s.workers.writes else [], setup.run_dir(s.config), cfg.project_name,
                                   cfg.experiment_name, config_dict(s.config), s.total_steps)
                if self.validate_first and s.global_step == 0 and not self._validate_first(tracker):
                    tracker.finish()
                    return s.history
                self.phase = "train"
                self._train(tracker)
                if self._finished() and self._final_checkpoint() is None and _exports_at_end(s):
                    scratch = self._save_scratch()  # while the workers are up
        finally:
            s.workers.shutdown()  # a failed rank must not leave the others waiting in a collective
            if self.on_exit is not None:
                self.on_exit(self.stop_signal is not None)
            if s.workers.writes:
                s.checkpoints.unlock()  # the folder's lock (one writer) ends with the run
        if self._finished() and s.workers.writes:
            self.model_dir = self._export(scratch)
            self._record_finish()
        if s.workers.writes:  # every stage's memory figure, one method: the process tree's peak (issue 41)
            run_peak_metrics(_own_peak(s))  # the line; each step's metrics carry the figure so far
        tracker.finish()
        return s.history

    def _finished(self) -> bool:
        s = self.stage
        return s.global_step == s.total_steps and s.stopped_by is None and self.stop_signal is None

    def _final_checkpoint(self) -> Path | None:
        """The checkpoint of the last step, saved by this run or found on resume (None: none was saved)."""
        s = self.stage  # decided alike on every rank (torchrun's ranks then save the scratch one together)
        if s.total_steps in (self.saved_step, self.resumed_step):
            return s.checkpoints.step_dir(s.total_steps)
        return None

    def _save_scratch(self) -> Any:
        """The final state written to a scratch checkpoint folder inside ``trainer.default_local_dir``
        (removed after the export), so that a run keeping no checkpoint still exports its model and
        the next run in that folder starts over, as it would have."""
        from posttrain.checkpoint import CheckpointManager

        s = self.stage
        real, scratch = s.checkpoints, CheckpointManager(s.checkpoints.root / f".final_export_{os.getpid()}")
        s.checkpoints = scratch
        try:
            self._save()
        finally:
            s.checkpoints = real
        return scratch

    def _export(self, scratch: Any) -> Path | None:
        """``hf_model/`` from the last step's checkpoint (or the scratch one), and the one line that says
        where it is and how to use it; a model with a non-finite weight is refused (`NonFiniteError`)."""
        import shutil

        s = self.stage
        source = scratch.step_dir(s.total_steps) if scratch is not None else self._final_checkpoint()
        if source is None:
            print(f"the trained model was not kept: trainer.save_freq={s.config.trainer.save_freq} saved no "
                  "checkpoint (set trainer.save_freq=N to keep one every N steps and export hf_model/ at the end)",
                  flush=True)
            return None
        try:
            out = export_final_model(source, s.checkpoints.root / HF_MODEL)
        finally:
            if scratch is not None:
                shutil.rmtree(scratch.root, ignore_errors=True)
        print(f"model: {out} (Hugging Face folder) - evaluate it: posttrain eval --model {out} | train on it: "
              f"posttrain train actor_rollout_ref.model.path={out}", flush=True)
        return out

    def _record_finish(self) -> None:
        """The folder records that this run finished, so that starting it again says so rather than training
        it again (`resume.check_folder_owner`). Once its model is exported, the checkpoints trainer.save_freq
        would not have kept (saved on a signal, to resume from) go: the export supersedes them."""
        s = self.stage
        if self.model_dir is not None:
            s.checkpoints.remove([p for p in s.checkpoints.step_dirs() if not self._kept_by_save_freq(p)])
        resume.mark_finished(s.checkpoints.root, s.total_steps, s.fingerprint(), self.model_dir)

    def _kept_by_save_freq(self, step_dir: Path) -> bool:
        s, step = self.stage, int(step_dir.name.rsplit("_", 1)[1])
        return _due(s.config.trainer.save_freq, step, step == s.total_steps, _saves_last(s))

    def _restore(self) -> None:
        s = self.stage
        run = s.restore()
        if run is None:
            return
        s.global_step = self.resumed_step = run.global_step
        s.first_validation = run.first_validation
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
            s.first_validation = dict(val)
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
            if _due(cfg.test_freq, s.global_step, last, _saves_last(s)) and not self._stopping():
                try:
                    metrics.update(s.validate())
                except RewardInterrupted:
                    print("validation interrupted; saving the step without its validation metrics", flush=True)
            if self.check is not None:
                self.check(metrics)
            if _due(cfg.save_freq, s.global_step, last, _saves_last(s)):
                self._save()
            metrics.update(run_peak_metrics(_own_peak(s), announce=False))
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
        """The last finished step is the run's last (saved when a last step is, and exported)."""
        s = self.stage
        s.total_steps = s.global_step
        if (s.config.trainer.save_freq > 0 or _saves_last(s)) and s.global_step > 0 and self.saved_step != s.global_step:
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


RUN_RESULTS = ("metrics.jsonl", "curves.png", "eval_cards", "tensorboard")
"""What a run writes in its run folder, besides the sample dumps; ``rollout_dirs.json`` stays (each run writes the
same pointer to its dumps before it starts)."""


def _set_aside_earlier_results(run_dir: Path, dumps: Any = None) -> None:
    """A run starting at step 0 would append its steps to the metrics.jsonl (and the dumps' index, the tensorboard
    events) an earlier run, or an earlier try that saved no checkpoint, left in its run folder: those results
    (`RUN_RESULTS`, and the sample dumps ``dumps`` writes inside the run folder) move to ``previous_run_<time>/``
    first. A dump folder elsewhere is the user's to keep apart (its index names each step's time)."""
    earlier = run_dir / "metrics.jsonl"
    if not earlier.is_file() or earlier.stat().st_size == 0:
        return
    inside = [d for d in (getattr(dumps, "train", None), getattr(dumps, "val", None))
              if d is not None and d.folder.resolve().is_relative_to(run_dir.resolve()) and d.folder.exists()]
    names = [n for n in RUN_RESULTS if (run_dir / n).exists()]
    names += [str(d.folder.resolve().relative_to(run_dir.resolve())) for d in inside]
    aside = run_dir / f"previous_run_{time.strftime('%Y%m%d-%H%M%S')}"
    n = 0
    while aside.exists():
        n += 1
        aside = run_dir / f"previous_run_{time.strftime('%Y%m%d-%H%M%S')}_{n}"
    for name in names:
        (aside / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(run_dir / name, aside / name)
    for dump in inside:
        dump.used = 0  # its bound counts this run's files only
    print(f"note: {run_dir} held the results of an earlier run ({', '.join(names)}); moved to {aside}/ (this run "
          "starts at step 0)", flush=True)


def _saves_last(stage: Any) -> bool:
    """verl's SFT trainer validates and saves at its last step whatever the frequencies say."""
    return bool(getattr(stage, "saves_last_step", False))


def _exports_at_end(stage: Any) -> bool:
    return bool(getattr(stage.config.trainer, "export_at_end", False))


def _due(freq: int, step: int, last: bool, always_last: bool) -> bool:
    """Whether a ``trainer.*_freq`` event falls on ``step`` (every ``freq`` steps and the last; -1 never)."""
    return (freq > 0 and (step % freq == 0 or last)) or (last and always_last)


def export_final_model(step_dir: Path, out: Path) -> Path:
    """The actor of ``step_dir`` as a Hugging Face folder ``out``; weights that are not finite end the
    run with `NonFiniteError` (exit code 3) and nothing is written."""
    from posttrain.trainer.export import NonFiniteWeights, export_actor

    try:
        return export_actor(step_dir, out)
    except NonFiniteWeights as err:
        raise NonFiniteError(f"the final model was not exported: {err}") from err


class NonFiniteGuard:
    """Stops a run after ``limit`` steps in a row whose update had a non-finite loss or gradient (a
    ``*nonfinite_skipped`` metric above 0) or any non-finite metric (`NonFiniteError`, exit code 3).

    Args:
        limit: ``trainer.max_consecutive_nonfinite``.
        hint: what to try, appended to the error.
    """

    def __init__(self, limit: int, hint: str, streak: int = 0):
        self.limit, self.hint, self.streak = limit, hint, streak
        self.last_finite: dict[str, float] = {}

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        import math

        skipped = sum(v for k, v in metrics.items() if k.endswith("nonfinite_skipped"))
        if skipped == 0 and all(math.isfinite(v) for v in metrics.values()):
            self.streak, self.last_finite = 0, metrics
            return
        self.streak += 1
        if self.streak >= self.limit:
            bad = sorted(k for k, v in metrics.items() if not math.isfinite(v))
            shown = {k: round(v, 5) for k, v in self.last_finite.items() if "loss" in k or "grad_norm" in k}
            raise NonFiniteError(
                f"step {step}: {self.streak} steps in a row had a non-finite loss or gradient (limit "
                f"trainer.max_consecutive_nonfinite={self.limit}; non-finite now: {', '.join(bad) or 'the update'}); "
                f"last finite metrics: {shown}. Nothing more is trained or exported. {self.hint}")


def config_dict(config: Any) -> dict:
    """The whole config as plain containers, for the tracker."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True)  # type: ignore[return-value]


class _StopOnSignals:
    """SIGINT/SIGTERM: let the current step finish, then save and stop; a second Ctrl-C aborts at once,
    unless it comes within `REPEAT_WINDOW_S` of the first: then it is the same request, sent twice.

    While rewards are being computed (a scorer may hang for up to ``reward.timeout_s``) the first
    signal stops at once: the handler raises `RewardInterrupted`, the step is undone (no weights had
    changed yet) and the last finished step is saved."""

    def __init__(self, loop: RunLoop):
        self.loop, self.previous = loop, {}
        self.first_at = 0.0  # time.monotonic() of the signal that asked to stop

    def _handler(self, signum, frame):
        loop = self.loop
        if loop.stop_signal is not None:
            if time.monotonic() - self.first_at < REPEAT_WINDOW_S:
                return  # the same Ctrl-C, delivered twice (a wrapper forwarding the terminal's)
            raise KeyboardInterrupt
        loop.stop_signal, self.first_at = signum, time.monotonic()
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
        print(f"\nreceived {signal.Signals(signum).name}: {what} (press Ctrl-C again, a second or more later, to "
              "abort now without saving)", flush=True)
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

    stopping = []

    def handler(signum, frame):
        if stopping:
            return  # already stopping: a repeated signal must not break the unwinding of the first
        stopping.append(signum)
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


def _own_peak(stage: Any) -> int:
    """This process's exact peak where the stage keeps one across phase resets (posttrain.host.resident)."""
    return getattr(getattr(stage, "memory", None), "run_peak", 0)
