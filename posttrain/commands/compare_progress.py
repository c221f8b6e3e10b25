"""What `posttrain compare` shows while a run trains: one line per new step, read from the run's own files.

A run writes its console lines to ``train.log`` (compare keeps the ``console`` logger on for that) and its
metrics to ``metrics.jsonl``. A background thread reads both every few seconds and prints, for each step
the run finished since the last line::

    [1/6] grpo seed 1: step 4/15, 0:01:02 elapsed, ETA 0:02:51 | score 0.406 | val-core/.../acc/mean@1 0.641 (step 0)

the step and its total, time and ETA from the run's console line (`posttrain.tracking.parse_progress`), the
training score of that step, and the compared metric's latest value with the step it was measured at.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Optional

from posttrain.commands import compare_report as report
from posttrain.errors import ConfigError
from posttrain.tracking import StepProgress, parse_progress

__all__ = ["RunProgress"]

SCORE_KEY = "critic/score/mean"
"""The step's mean training score (verl's name): the one per-step signal between two validations."""


class RunProgress:
    """Prints a run's new steps while it trains (``with RunProgress(...):`` around the run).

    Args:
        prefix: what each line starts with (``[1/6] grpo seed 1``).
        folder: the run's folder (``train.log``, ``metrics.jsonl``).
        metric: the compared metric (``--metric``), or None for the one the report picks (`accuracy_key`).
        interval: seconds between two reads.
        emit: where a line goes.
    """

    def __init__(self, prefix: str, folder: Path, metric: Optional[str], interval: float = 2.0,
                 emit: Callable[[str], None] = lambda line: print(line, flush=True)):
        self.prefix, self.folder, self.metric, self.interval, self.emit = prefix, folder, metric, interval, emit
        self._log_offset = _size(folder / "train.log")  # an earlier attempt's lines are not this attempt's
        self._metrics_file = _identity(folder / "metrics.jsonl")
        self._shown = max(report.read_metrics(folder / "metrics.jsonl"), default=0)  # steps logged before
        self._progress: dict[int, StepProgress] = {}  # by step, from the run's console lines
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="compare-progress", daemon=True)

    def __enter__(self) -> "RunProgress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()  # the last steps, written between the last read and the run's end

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        """Read what the run wrote since the last call; print a line for each step it finished since the last line."""
        path = self.folder / "metrics.jsonl"
        if _identity(path) != self._metrics_file:  # a run starting at step 0 moves an earlier run's file aside
            self._metrics_file, self._shown = _identity(path), 0
        rows = report.read_metrics(path)
        self._read_log()  # after the metrics: a step's console line is written before its metrics (compare_runs)
        for step in sorted(s for s in rows if s > self._shown):
            self.emit(self.line(step, rows))
            self._shown = step

    def line(self, step: int, rows: dict[int, dict]) -> str:
        """``prefix: step i/N, elapsed, ETA | score | the metric's value as of step i``."""
        where, total = f"step {step}", max((p.total for p in self._progress.values()), default=None)
        if total is not None:
            where += f"/{total}"
        if step in self._progress:
            where += f", {self._progress[step].elapsed} elapsed, ETA {self._progress[step].eta}"
        parts = [f"{self.prefix}: {where}"]
        if SCORE_KEY in rows[step]:
            parts.append(f"score {rows[step][SCORE_KEY]:.3g}")
        parts.append(self._metric_text({s: row for s, row in rows.items() if s <= step}))
        return " | ".join(parts)

    def _metric_text(self, rows: dict[int, dict]) -> str:
        try:
            key = report.accuracy_key([rows], self.metric)
        except ConfigError:  # no validation yet (or not this metric: compare checks it once the run ends)
            return f"{self.metric or 'held-out accuracy'}: not logged yet"
        measured = max(s for s, row in rows.items() if key in row)
        return f"{key} {rows[measured][key]:.3g} (step {measured})"

    def _read_log(self) -> None:
        path = self.folder / "train.log"
        try:
            with path.open("rb") as f:
                f.seek(self._log_offset)
                text = f.read()
        except OSError:
            return
        complete = text.rfind(b"\n") + 1  # a line still being written is read next time
        self._log_offset += complete
        for line in text[:complete].decode("utf-8", errors="replace").splitlines():
            found = parse_progress(line)
            if found is not None:
                self._progress[found.step] = found


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file now at ``path``, None when there is none."""
    try:
        found = path.stat()
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
