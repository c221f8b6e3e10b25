"""Run folders as `posttrain view` reads them: which folders are runs, where their samples are, and
the appended files (metrics.jsonl, the dumps' index.jsonl) read from an offset to their last whole line,
so a page that polls a run still writing gets each line once and never half of one.

A run folder is ``trainer.run_dir`` (``metrics.jsonl`` from the ``file`` logger, ``rollout_dirs.json``
naming the sample dumps), a dump folder itself (``index.jsonl``), or a folder with ``compare_run.json``
(a run of ``posttrain compare``). A folder that is none of these but holds runs below it (a compare folder
``<A>/seed<k>/``, ``outputs/``) stands for those runs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.errors import PosttrainError
from posttrain.trainer.rollout_dump import INDEX, POINTER, step_file

__all__ = ["Run", "ViewError", "beside", "find_runs", "read_tail", "run_of"]

METRICS = "metrics.jsonl"
COMPARE_RECORD = "compare_run.json"
SKIP_DIRS = {"checkpoints", "hf_model", "rollouts", "validation", "__pycache__", "tensorboard", "wandb", "mlruns"}
CARD_DEPTH = 2  # eval cards (*card*.json) are looked for this many folders deep in a run folder


class ViewError(PosttrainError):
    """Input `posttrain view` cannot show: the message is the one line the user reads."""

    exit_code = 2


@dataclass
class Run:
    """One run: its folder and where its files are (any may be missing while it starts)."""

    name: str
    folder: Path
    dumps: dict[str, Path] = field(default_factory=dict)
    """``train`` / ``val``: the sample dump folders (trainer.rollout_data_dir / validation_data_dir)."""

    def __post_init__(self) -> None:
        if not self.dumps:
            self.refresh()

    @property
    def metrics(self) -> Path:
        return self.folder / METRICS

    def refresh(self) -> None:
        """Find the dump folders again (a run that has just started writes its pointer after its first lines)."""
        self.dumps = _dump_folders(self.folder)

    def step_path(self, kind: str, step: int) -> Path:
        if kind not in self.dumps:
            self.refresh()
        if kind not in self.dumps:
            what = "trainer.rollout_data_dir" if kind == "train" else "trainer.validation_data_dir"
            raise ViewError(f"run {self.name} has no {'training' if kind == 'train' else 'validation'} samples "
                            f"({what} was not set when it ran)")
        path = self.dumps[kind] / step_file(step)
        if not path.is_file():
            raise ViewError(f"step {step} of run {self.name}: {path} is missing (deleted, or not written: the "
                            f"folder's size bound, or the run stopped before it)")
        return path

    def cards(self) -> list[Path]:
        """Eval cards (``*card*.json``, or any JSON in a folder named ``*card*``: in-run validation writes
        ``eval_cards/step_<N>.json``) in the run folder and up to `CARD_DEPTH` folders below it."""
        found = []
        for root, dirs, files in os.walk(self.folder):
            depth = len(Path(root).relative_to(self.folder).parts)
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(".") and depth < CARD_DEPTH)
            in_card_folder = any("card" in part.lower() for part in Path(root).relative_to(self.folder).parts)
            found += [Path(root) / f for f in sorted(files)
                      if f.endswith(".json") and ("card" in f.lower() or in_card_folder)]
        return found

    def describe(self) -> dict:
        self.refresh()
        return {"name": self.name, "path": str(self.folder), "metrics": self.metrics.is_file(),
                "train": "train" in self.dumps, "val": "val" in self.dumps,
                "cards": [str(p.relative_to(self.folder)) for p in self.cards()]}


def _dump_folders(folder: Path) -> dict[str, Path]:
    """The run's dump folders: ``rollouts/`` and ``validation/`` inside it (the built-in run's, and a copied
    run's), else those its ``rollout_dirs.json`` names, else the folder itself when it is a dump."""
    dumps: dict[str, Path] = {}
    for kind, sub in (("train", "rollouts"), ("val", "validation")):
        if (folder / sub / INDEX).is_file():
            dumps[kind] = folder / sub
    pointer = folder / POINTER
    if pointer.is_file():
        try:
            named = json.loads(pointer.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            named = {}
        for kind, key in (("train", "rollout_data_dir"), ("val", "validation_data_dir")):
            if kind not in dumps and isinstance(named, dict) and named.get(key) and Path(named[key]).is_dir():
                dumps[kind] = Path(named[key])
    if not dumps and (folder / INDEX).is_file():  # a dump folder named on its own
        dumps[_index_kind(folder / INDEX)] = folder
    return dumps


def _index_kind(index: Path) -> str:
    try:
        with open(index, encoding="utf-8") as f:
            return "val" if json.loads(f.readline()).get("kind") == "val" else "train"
    except (OSError, ValueError, AttributeError):
        return "train"


def is_run(folder: Path) -> bool:
    return any((folder / name).is_file() for name in (METRICS, POINTER, COMPARE_RECORD, INDEX)) or \
        any((folder / sub / INDEX).is_file() for sub in ("rollouts", "validation"))


def _runs_below(folder: Path, depth: int = 3) -> list[Path]:
    found = []
    for root, dirs, _ in os.walk(folder):
        here = Path(root)
        if here != folder and is_run(here):
            found.append(here)
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")
                         and len(here.relative_to(folder).parts) < depth)
    return found


def run_of(path: str | os.PathLike) -> list[Run]:
    """The runs ``path`` stands for: itself, or the runs below it (a compare folder: ``A/seed1``, ...)."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ViewError(f"{path} does not exist")
    if not folder.is_dir():
        raise ViewError(f"{path} is a file, not a run folder (give the folder that holds metrics.jsonl)")
    if is_run(folder):
        return [Run(folder.resolve().name, folder.resolve())]
    below = _runs_below(folder)
    if not below:
        raise ViewError(f"{path} is not a run folder: it holds no {METRICS} (the `file` logger), {POINTER} or "
                        f"rollouts/{INDEX}, and no run folders below it (a run's folder is trainer.run_dir, by default "
                        "outputs/<project>/<experiment>)")
    return [Run(str(p.relative_to(folder)), p.resolve()) for p in below]


def find_runs(paths: list[str]) -> list[Run]:
    """The runs of every path (no path: the runs under ./outputs, newest first), each named uniquely."""
    if not paths:
        if not Path("outputs").is_dir():
            raise ViewError("no run folder given and no outputs/ folder here: posttrain view RUN_FOLDER (a run's "
                            "trainer.run_dir, by default outputs/<project>/<experiment>)")
        runs = sorted(run_of("outputs"), key=lambda r: -_mtime(r.folder))
    else:
        runs = [run for p in paths for run in run_of(p)]
    seen: dict[Path, Run] = {}
    for run in runs:
        seen.setdefault(run.folder, run)
    runs = list(seen.values())
    names = [r.name for r in runs]
    for r in runs:
        if names.count(r.name) > 1:  # two folders named alike: say which parent
            r.name = f"{r.folder.parent.name}/{r.folder.name}"
    return runs


def beside(runs: list[Run], named: bool) -> int | None:
    """The run the page shows beside the first: the second of two runs named on the command line, or in a
    compare folder (``A/seed1``, ``B/seed1``, ...) the other config's run of the first one's seed."""
    parts = [r.name.split("/") for r in runs]
    if len(runs) > 2 and all(len(p) == 2 and p[1].startswith("seed") for p in parts):
        return next((i for i, p in enumerate(parts) if p[1] == parts[0][1] and p[0] != parts[0][0]), None)
    return 1 if named and len(runs) == 2 else None


def _mtime(folder: Path) -> float:
    times = [p.stat().st_mtime for p in (folder / METRICS, folder / POINTER, folder) if p.exists()]
    return max(times)


def read_tail(path: Path, offset: int, limit: int = 64 << 20) -> tuple[bytes, int, bool]:
    """``(whole lines from offset, the next offset, reset)``: the bytes from ``offset`` up to the file's last
    newline (at most ``limit``); ``reset`` when the file is shorter than ``offset`` (written anew: read from 0)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return b"", 0, offset > 0
    reset = offset > size
    if reset:
        offset = 0
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(min(size - offset, limit))
    end = data.rfind(b"\n") + 1
    return data[:end], offset + end, reset
