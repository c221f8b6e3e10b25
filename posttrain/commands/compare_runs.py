"""The runs of `posttrain compare`: one folder per (config, seed) under the compare folder, each run a
`python -m posttrain.trainer.main_ppo` process, resumable.

A run's folder holds `compare_run.json` (the command and its attempts), `train.log`, `metrics.jsonl`
(the `file` logger) and `checkpoints/`. A run whose record says done is skipped; any other resumes from
its latest checkpoint (`trainer.resume_mode=auto`), so stopping `posttrain compare` at any moment and
calling it again loses at most the steps since the last save.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from posttrain.errors import ConfigError

RECORD = "compare_run.json"
Launcher = Callable[[list[str], Path], int]
"""Runs `python -m ARGV` (a module and its arguments), its output into the log file; returns the exit code."""


@dataclass(frozen=True)
class RunSpec:
    side: str
    """The config's name (A, B or --names)."""
    seed: int
    folder: Path
    argv: tuple[str, ...]
    """The module to run (`posttrain.cli` or `posttrain.trainer.main_ppo`) and its arguments, the per-run keys last."""


@dataclass
class RunOutcome:
    spec: RunSpec
    status: str
    """done, failed or stopped."""
    returncode: int = 0
    reason: str = ""
    wall_s: float = 0.0
    """Seconds of all attempts (start-up, validations and saves included)."""
    attempts: list[dict] = field(default_factory=list)


def run_keys(folder: Path, seed: int, trainer_cfg, save_freq: int) -> list[str]:
    """The keys compare sets on every run: its seed (model sampling and prompt order alike, so A and B
    see the same data in the same order), its folders, the `file` logger (the report's numbers) and the
    `console` one first (its step lines in train.log are what compare shows of a run in progress:
    `compare_progress`), and a save cadence that lets an interrupted run resume (only the newest
    checkpoint kept)."""
    keys = [f"trainer.seed={seed}", f"data.seed={seed}", f"trainer.run_dir={folder}",
            f"trainer.default_local_dir={folder / 'checkpoints'}", "trainer.resume_mode=auto", "trainer.start_over=False"]
    loggers = list(trainer_cfg.logger)
    wanted = (["console"] if "console" not in loggers else []) + loggers + (["file"] if "file" not in loggers else [])
    if wanted != loggers:
        keys.append("trainer.logger=[" + ",".join(wanted) + "]")
    if trainer_cfg.save_freq <= 0:
        keys.append(f"trainer.save_freq={save_freq}")
    if trainer_cfg.max_actor_ckpt_to_keep is None:
        keys.append("trainer.max_actor_ckpt_to_keep=1")
    if trainer_cfg.max_critic_ckpt_to_keep is None:
        keys.append("trainer.max_critic_ckpt_to_keep=1")
    return keys


def read_record(folder: Path) -> dict | None:
    path = folder / RECORD
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON ({err}); delete it to start this run again") from None


def _write_record(folder: Path, record: dict) -> None:
    tmp = folder / (RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=1), encoding="utf-8")
    os.replace(tmp, folder / RECORD)


def check_folder(spec: RunSpec) -> dict:
    """The run's record, new or as left by an earlier call; a folder holding another command's run is refused."""
    record = read_record(spec.folder)
    if record is None:
        return {"argv": list(spec.argv), "done": False, "attempts": []}
    if record.get("argv") != list(spec.argv):
        raise ConfigError(f"{spec.folder} holds a run of a different command (its {RECORD} names other arguments); "
                          "choose another --out, or delete that folder to run it again")
    return record


def subprocess_launcher(argv: list[str], log: Path) -> int:
    """`python -m ARGV` (`posttrain.cli train ...`: what `posttrain train` runs), in a child process. Ctrl-C
    reaches the child from the terminal and SIGTERM is passed on: either way the child finishes its step
    and saves before it exits, and this waits for it."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    with log.open("a", encoding="utf-8") as out:
        proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signal.SIGTERM))
        try:
            while True:
                try:
                    return proc.wait()
                except KeyboardInterrupt:
                    continue  # the child got the same Ctrl-C; it saves, then exits 130
        finally:
            signal.signal(signal.SIGTERM, previous)


def _failure_reason(log: Path) -> str:
    """The child's `error:` line, else its last line."""
    try:
        lines = [ln.strip() for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    errors = [ln for ln in lines if ln.startswith("error:") or ln.endswith("Error") or "Error: " in ln]
    return (errors or lines or ["no output"])[-1][:300]


def _stopped_by_signal(returncode: int) -> bool:
    return returncode < 0 or returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM)


def run_one(spec: RunSpec, launch: Launcher, keep_checkpoints: bool) -> RunOutcome:
    """Run (or resume) one run unless its record says it finished."""
    record = check_folder(spec)
    wall = sum(a.get("wall_s", 0.0) for a in record["attempts"])
    if record["done"]:
        return RunOutcome(spec, "done", 0, "finished earlier", wall, record["attempts"])
    spec.folder.mkdir(parents=True, exist_ok=True)
    _write_record(spec.folder, record)
    log = spec.folder / "train.log"
    start = time.monotonic()
    returncode = launch(list(spec.argv), log)
    seconds = time.monotonic() - start
    record["attempts"].append({"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - seconds)),
                               "wall_s": round(seconds, 2), "returncode": returncode})
    record["done"] = returncode == 0
    _write_record(spec.folder, record)
    wall += seconds
    if returncode == 0:
        if not keep_checkpoints:
            _drop_checkpoints(spec.folder / "checkpoints")
        return RunOutcome(spec, "done", 0, "", wall, record["attempts"])
    status = "stopped" if _stopped_by_signal(returncode) else "failed"
    return RunOutcome(spec, status, returncode, _failure_reason(log), wall, record["attempts"])


def _drop_checkpoints(root: Path) -> None:
    """A finished run's resumable checkpoints (global_step_N: actor, critic, optimizer state) are only
    there to resume it; its final model (hf_model/) stays."""
    if not root.is_dir():
        return
    for child in root.iterdir():
        if child.is_dir() and child.name.startswith("global_step_"):
            shutil.rmtree(child, ignore_errors=True)
    (root / "latest_checkpointed_iteration.txt").unlink(missing_ok=True)
