"""Checkpoints in verl's layout, written atomically and loaded without executing code.

```
root/
  latest_checkpointed_iteration.txt   N, written last: the commit point of a save
  global_step_N/
    actor/    model.safetensors  optimizer.pt  lr_scheduler.pt  [generator.pt]   (one process)
              or dcp/ (torch.distributed.checkpoint: each rank's shards) + lr_scheduler.pt ... (FSDP2)
              huggingface/       config.json + tokenizer files (enough to export the actor alone)
    critic/   the same files
    extra_state.json                  trainer step, data sampler, KL controller, config fingerprint
    rng_state.pt                      the driver's python / numpy / torch (/ cuda) generator states
    rng/rank_<r>.pt                   each rank's own: those, plus its roles' shuffle generators
                                      (written by the ranks, `posttrain.checkpoint.rank_rng`)
    COMPLETE                          manifest {file: size} + {file: sha256}, the last file written before the rename
```

A save writes everything into `root/.tmp_global_step_N_<pid>/`, fsyncs it, writes `COMPLETE`,
renames the folder to `global_step_N`, then replaces the tracker. A process killed at any moment
leaves the previous or the new checkpoint complete; leftovers (`.tmp_*`, `.old_*`, `.trash_*`)
are ignored by readers and removed by the next save. Only one driver may save into a root; the
role folders inside the temporary folder may be written by many ranks (``save(step, writer, ...)``
hands the writer the temporary folder and seals it once the writer returns).

Loading never runs code from the checkpoint: safetensors for weights, JSON, and
`torch.load(weights_only=True)`, whose refusal becomes a `CheckpointError` naming the file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import socket
import time
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from posttrain.host.disk import DiskWriteError, naming, readable_as_umask_says, save_torch, writing
from posttrain.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "CheckpointManager",
    "LoadedCheckpoint",
    "RoleState",
    "capture_rng",
    "check_weights_fit",
    "checkpoint_problem",
    "is_step_dir_name",
    "load_checkpoint",
    "load_role",
    "open_tensors",
    "read_run_state",
    "restore_rng",
    "safe_torch_load",
    "verify_checkpoint",
    "write_role",
]

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
MARKER = "COMPLETE"
EXTRA_FILE = "extra_state.json"
RNG_FILE = "rng_state.pt"
HF_DIR = "huggingface"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "lr_scheduler.pt"
GENERATOR_FILE = "generator.pt"
FINGERPRINT_KEY = "config_fingerprint"

_STEP_DIR = re.compile(r"global_step_(\d+)")
_OLD_DIR = re.compile(r"\.old_global_step_(\d+)_\d+")
_SCRATCH = (".tmp_", ".old_", ".trash_")
_ROLE_NAME = re.compile(r"[A-Za-z0-9_]+")

class CheckpointWriteError(CheckpointError, DiskWriteError):
    """A checkpoint could not be written (full disk, quota, read-only, permissions); names the path."""


def write_failed_advice(root: str | os.PathLike) -> str:
    """What to do when a save into ``root`` fails before its folder is in place (the end of
    `posttrain.host.disk.write_failure_message`), and what is left: called before the save, it names
    the newest complete checkpoint already there, or says there is none."""
    newest = _newest_complete(Path(root).expanduser())
    kept = (f"the previous checkpoint in {root} is intact ({newest.name}" if newest is not None else
            f"nothing of this save is left in {root}, which holds no earlier checkpoint (")
    return (f"set trainer.default_local_dir to a folder on another disk; {kept}: a save is written aside and "
            "renamed into place only when complete)")


def tracker_failed_advice(root: Path, step: int) -> str:
    """What is true when step ``step``'s folder is in place but the tracker could not point at it."""
    tracked = CheckpointManager(root).tracked_step()
    resumes = (f"global_step_{tracked}, the step {TRACKER} still names" if tracked is not None else
               f"global_step_{step}, the newest complete checkpoint (there is no {TRACKER})")
    return (f"set trainer.default_local_dir to a folder on another disk; global_step_{step} in {root} is complete, "
            f"but a resume would start from {resumes} (trainer.resume_mode=resume_path "
            f"trainer.resume_from_path={root / f'global_step_{step}'} picks the new one)")


def _newest_complete(root: Path) -> Path | None:
    if not root.is_dir():
        return None
    complete = [p for p in CheckpointManager(root).step_dirs() if _problem(p) is None]
    return complete[-1] if complete else None


@dataclass
class RoleState:
    """What one role (actor, critic) saves. Everything but ``model`` is optional."""

    model: dict[str, torch.Tensor]
    """state_dict of tensors -> model.safetensors (tied / shared tensors are written as copies)."""
    optimizer: dict | None = None
    """optimizer.state_dict() -> optimizer.pt."""
    scheduler: dict | None = None
    """lr_scheduler.state_dict() -> lr_scheduler.pt."""
    generator: torch.Tensor | None = None
    """The worker's shuffle-generator state (torch.Generator.get_state()) -> generator.pt."""
    hf_config: Any = None
    """transformers PretrainedConfig -> huggingface/config.json (needed by `posttrain export`)."""
    tokenizer: Any = None
    """Tokenizer -> huggingface/."""


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    roles: dict[str, Any]
    """role name -> `RoleState` (`load_checkpoint`) or its folder (`read_run_state`)."""
    extra: dict[str, Any]
    rng: dict[str, Any] = field(default_factory=dict)


class CheckpointManager:
    """Saves, finds, prunes and loads the checkpoints under one root folder."""

    def __init__(self, root_dir: str | os.PathLike, max_actor_ckpt_to_keep: int | None = None,
                 max_critic_ckpt_to_keep: int | None = None):
        self.root = Path(root_dir).expanduser()
        # verl: null or a non-positive number keeps everything.
        self.keep = {"actor": max_actor_ckpt_to_keep, "critic": max_critic_ckpt_to_keep}

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{int(step)}"

    # ------------------------------------------------------------------ one writer
    def lock(self) -> None:
        """Claim the root for this process (creating it): one writer per checkpoint folder.

        An exclusive ``flock`` on ``root/.lock``, which also names the holder (pid, host, start time)
        and is removed when the run ends. The kernel drops the lock when the process ends, even by
        SIGKILL, so a ``.lock`` left by a killed run never blocks a resume. Raises `CheckpointError` naming the other process when another one holds it. The
        same process may lock a root several times (one count per call; see `unlock`).
        """
        _lock_root(self.root)

    def unlock(self) -> None:
        _unlock_root(self.root)

    # ------------------------------------------------------------------ save
    def save(self, step: int, roles: Mapping[str, RoleState] | Callable[[Path], Iterable[str]],
             extra: Mapping[str, Any]) -> Path:
        """Write ``global_step_{step}`` atomically, point the tracker at it, prune; returns its path.

        ``roles``: ``{name: RoleState}``, or a writer ``fn(folder) -> role names`` that writes one
        sub-folder per role into ``folder`` (the workers' own ``save_checkpoint``, possibly on many ranks).
        """
        # a full disk, a folder made read-only: one error naming the path and saying what is left, which
        # depends on how far the save got (nothing of it, or its folder in place but not yet tracked)
        with writing(self.root, f"saving the checkpoint of step {step} failed", write_failed_advice(self.root),
                     error=CheckpointWriteError):
            final = self._save(step, roles, extra)
        with writing(self.root, f"saving the checkpoint of step {step} failed at its last write, the tracker",
                     tracker_failed_advice(self.root, int(step)), error=CheckpointWriteError):
            self._write_tracker(int(step))
        with writing(self.root, f"step {step}'s checkpoint is saved and tracked, but removing older ones failed",
                     "set max_actor_ckpt_to_keep/max_critic_ckpt_to_keep to null", error=CheckpointWriteError):
            self._prune()
        return final

    def _save(self, step, roles, extra) -> Path:
        """Write the step's folder aside and rename it into place (not yet tracked)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._recover()
        self._clean_scratch()
        tmp = self.root / f".tmp_global_step_{int(step)}_{os.getpid()}"
        tmp.mkdir()
        try:
            names = _write_roles(tmp, roles)
            _write_json(tmp / EXTRA_FILE, dict(extra))
            save_torch(capture_rng(), tmp / RNG_FILE)
            _seal(tmp, int(step), names)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a killed process leaves it to the next save instead
            raise
        final = self.step_dir(step)
        self._install(tmp, final)
        return final

    def _install(self, tmp: Path, final: Path) -> None:
        """Rename the sealed folder into place; an existing one is moved aside first, deleted after."""
        old = None
        if final.exists():
            old = self.root / f".old_{final.name}_{os.getpid()}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        if old is not None:
            self._discard(old)

    def _write_tracker(self, step: int) -> None:
        tmp = self.root / f".tmp_tracker_{os.getpid()}"
        _write_bytes(tmp, str(step).encode())
        os.replace(tmp, self.root / TRACKER)
        _fsync_dir(self.root)

    def _recover(self) -> None:
        """Put back a checkpoint moved aside by a save that died before its replacement landed."""
        for old in sorted(self.root.iterdir()):
            match = _OLD_DIR.fullmatch(old.name)
            if match and not self.step_dir(int(match[1])).exists() and _problem(old) is None:
                os.replace(old, self.step_dir(int(match[1])))
                _fsync_dir(self.root)

    def _clean_scratch(self) -> None:
        for entry in self.root.iterdir():
            if entry.name.startswith(_SCRATCH):
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)

    def _discard(self, path: Path) -> None:
        """Rename to root/.trash_* first, so a half-deleted folder never looks like a checkpoint."""
        trash = self.root / f".trash_{path.relative_to(self.root).as_posix().replace('/', '__')}_{os.getpid()}"
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    # ------------------------------------------------------------------ prune
    def _prune(self) -> None:
        """Keep the newest N checkpoints of each limited role; never touch the tracked one."""
        tracked = self.tracked_step()
        found = []  # (step, path, manifest), newest first
        for path in reversed(self.step_dirs()):
            if _problem(path) is None:
                manifest = _read_manifest(path)
                found.append((int(manifest["step"]), path, manifest))
        dropped: dict[int, set[str]] = {}
        for role, limit in self.keep.items():
            if limit is None or int(limit) <= 0:
                continue
            holders = [step for step, _, manifest in found if role in manifest["roles"]]
            for step in holders[int(limit):]:
                dropped.setdefault(step, set()).add(role)
        for step, path, manifest in found:
            if step == tracked or step not in dropped:
                continue
            remaining = [r for r in manifest["roles"] if r not in dropped[step]]
            if not remaining:
                self._discard(path)
            else:
                self._drop_roles(path, manifest, remaining)

    def _drop_roles(self, path: Path, manifest: dict, remaining: list[str]) -> None:
        """Rewrite the manifest without the dropped roles first, then delete their folders."""
        gone = [r for r in manifest["roles"] if r not in remaining]
        files = {f: size for f, size in manifest["files"].items() if f.split("/", 1)[0] not in gone}
        hashes = {f: h for f, h in manifest.get("sha256", {}).items() if f in files}
        tmp = self.root / f".tmp_manifest_{os.getpid()}"
        _write_bytes(tmp, json.dumps({**manifest, "roles": remaining, "files": files, "sha256": hashes},
                                     indent=1).encode())
        os.replace(tmp, path / MARKER)
        _fsync_dir(path)
        for role in gone:
            if (path / role).exists():
                self._discard(path / role)

    def remove(self, paths: Iterable[Path]) -> None:
        """Delete these checkpoints (each renamed aside first); the tracker goes too when it named one of them."""
        tracked = self.tracked_step()
        for path in paths:
            self._discard(path)
        if tracked is not None and not self.step_dir(tracked).exists():
            (self.root / TRACKER).unlink(missing_ok=True)

    # ------------------------------------------------------------------ find
    def step_dirs(self) -> list[Path]:
        """Every ``global_step_N`` folder (complete or not), oldest first."""
        if not self.root.is_dir():
            return []
        dirs = [p for p in self.root.iterdir() if _STEP_DIR.fullmatch(p.name) and p.is_dir()]
        return sorted(dirs, key=lambda p: int(_STEP_DIR.fullmatch(p.name)[1]))

    def tracked_step(self) -> int | None:
        try:
            return int((self.root / TRACKER).read_text().strip())
        except (OSError, ValueError):
            return None

    def latest(self) -> Path | None:
        """The tracker's checkpoint if complete, else the newest complete one (with a warning), else None.

        Read-only: a checkpoint moved aside by a save that died mid-replace is returned where it lies.
        """
        if not self.root.is_dir():
            return None
        tracked = self.tracked_step()
        if tracked is not None:
            path = self._located(tracked)
            problem = _problem(path)
            if problem is None:
                return path
            logger.warning("%s says step %d but %s; falling back to the newest complete checkpoint",
                           self.root / TRACKER, tracked, problem)
        complete = [p for p in self.step_dirs() if _problem(p) is None]
        if not complete:
            return None
        if tracked is None:
            logger.warning("%s has no %s; using the newest complete checkpoint %s",
                           self.root, TRACKER, complete[-1].name)
        return complete[-1]

    def _located(self, step: int) -> Path:
        path = self.step_dir(step)
        if not path.exists():
            for old in sorted(self.root.glob(f".old_global_step_{step}_*")):
                if _problem(old) is None:
                    return old
        return path

    # ------------------------------------------------------------------ load
    def load(self, path: str | os.PathLike | int, *, hf: bool = False) -> LoadedCheckpoint:
        """Load a ``global_step_N`` folder (or step number under this root); see `load_checkpoint`."""
        return load_checkpoint(self.step_dir(path) if isinstance(path, int) else path, hf=hf)


# ---------------------------------------------------------------------- one writer per root
LOCK_FILE = ".lock"
_LOCKS: dict[str, list] = {}  # resolved root -> [fd, count] held by this process


def _lock_root(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        key = str(root.resolve())
    except OSError as err:
        raise CheckpointError(f"cannot create the checkpoint folder {root}: {err.strerror or err}") from None
    held = _LOCKS.get(key)
    if held is not None:
        held[1] += 1
        return
    path = root / LOCK_FILE
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise CheckpointError(f"cannot write in the checkpoint folder {root}: {err.strerror or err}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise CheckpointError(
                f"checkpoint folder {root} is in use by another run ({holder}); only one run may write its "
                "checkpoints: wait for that run to end or stop it, or use another trainer.default_local_dir") from None
        try:  # the holder we waited for may have removed the file on release: lock the file that is there
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    info = f"pid {os.getpid()} on host {socket.gethostname()}, started {started}".encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
    except OSError as err:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        raise CheckpointError(f"cannot write in the checkpoint folder {root}: {err.strerror or err}") from None
    _LOCKS[key] = [fd, 1]


def _unlock_root(root: Path) -> None:
    try:
        key = str(root.resolve())
    except OSError:
        return
    held = _LOCKS.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] <= 0:
        del _LOCKS[key]
        try:  # removed while still locked (a run that waits re-checks the file it locked, see _lock_root)
            os.unlink(root / LOCK_FILE)
        except OSError:
            pass
        fcntl.flock(held[0], fcntl.LOCK_UN)
        os.close(held[0])


# ---------------------------------------------------------------------- writing
def _write_roles(folder: Path, roles: Mapping[str, RoleState] | Callable[[Path], Iterable[str]]) -> list[str]:
    if callable(roles):
        names = list(roles(folder))
        _check_role_names(names)
    else:
        names = list(roles)
        _check_role_names(names)
        for name, role in roles.items():
            write_role(folder / name, role)
    missing = [n for n in names if not (folder / n).is_dir()]
    if missing:
        raise CheckpointError(f"the role writer reported {missing} but wrote no such folder in {folder}")
    return names


def check_weights_fit(source: Path | str, saved: dict[str, tuple], model: dict[str, tuple],
                      strict: bool = True) -> None:
    """Refuse weights saved from a model of another shape (``name -> shape`` of both; ``strict``: the
    names must match too) with one `CheckpointError` naming the file, a parameter and both shapes,
    instead of torch's size-mismatch traceback."""
    differ = [(k, saved[k], shape) for k, shape in model.items() if k in saved and tuple(saved[k]) != tuple(shape)]
    missing = sorted(set(model) - set(saved)) if strict else []
    unexpected = sorted(set(saved) - set(model)) if strict else []
    if not (differ or missing or unexpected):
        return
    parts = []
    if differ:
        name, was, now = differ[0]
        more = f" ({len(differ) - 1} more parameters differ)" if len(differ) > 1 else ""
        parts.append(f"parameter {name} has shape {list(was)} in the checkpoint but {list(now)} in this model{more}")
    if missing:
        parts.append(f"{len(missing)} parameters of this model are not in the checkpoint (e.g. {missing[:2]})")
    if unexpected:
        parts.append(f"the checkpoint holds {len(unexpected)} parameters this model lacks (e.g. {unexpected[:2]})")
    raise CheckpointError(f"{source}: saved from a model of another shape: {'; '.join(parts)}. Resume with the model "
                          "the checkpoint was trained from (the model path it was saved with), or start over with "
                          "trainer.start_over=True or another trainer.default_local_dir")


def _check_role_names(names: list[str]) -> None:
    if not names:
        raise CheckpointError("save() needs at least one role (e.g. {'actor': RoleState(...)})")
    bad = [name for name in names if not _ROLE_NAME.fullmatch(name)]
    if bad:
        raise CheckpointError(f"role names must be plain folder names, got {bad}")


def write_role(folder: Path, role: RoleState) -> None:
    """One role's files (model.safetensors, optimizer.pt, ...) into a new ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir()
    with naming(folder / MODEL_FILE):  # safetensors names no file in its errors
        save_file(_unshared(role.model), folder / MODEL_FILE, metadata={"format": "pt"})
    for obj, name in ((role.optimizer, OPTIMIZER_FILE), (role.scheduler, SCHEDULER_FILE),
                      (role.generator, GENERATOR_FILE)):
        if obj is not None:
            save_torch(obj, folder / name)
    if role.hf_config is not None:
        role.hf_config.save_pretrained(folder / HF_DIR)
    if role.tokenizer is not None:
        role.tokenizer.save_pretrained(folder / HF_DIR)


def _unshared(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors with no two sharing storage (tied embeddings become two copies)."""
    out, seen = {}, set()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"model state {key!r} is a {type(value).__name__}, not a tensor")
        tensor = value.detach().cpu().contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[key] = tensor
    return out


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (torch.Tensor, np.ndarray, np.generic)):
        return obj.tolist()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def _write_json(path: Path, obj: Any) -> None:
    try:
        text = json.dumps(obj, indent=1, default=_json_default)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{path.name}: extra state must be JSON-able ({err})") from None
    _write_bytes(path, text.encode())


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _seal(folder: Path, step: int, roles: list[str]) -> None:
    """fsync every file and folder, then write the COMPLETE manifest (sizes and sha256, fsynced) last."""
    readable_as_umask_says(folder)  # the roles' safetensors come out of mkstemp as 0600
    files, hashes = {}, {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = Path(dirpath) / name
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            rel = path.relative_to(folder).as_posix()
            files[rel] = path.stat().st_size
            hashes[rel] = _file_hash(path)
    for dirpath, _, _ in os.walk(folder):
        _fsync_dir(Path(dirpath))
    manifest = {"step": step, "roles": roles, "files": dict(sorted(files.items())),
                "sha256": dict(sorted(hashes.items()))}
    _write_bytes(folder / MARKER, json.dumps(manifest, indent=1).encode())
    _fsync_dir(folder)


# ---------------------------------------------------------------------- reading
def _read_manifest(path: Path) -> dict | None:
    try:
        manifest = json.loads((path / MARKER).read_text())
        int(manifest["step"]), list(manifest["roles"]), dict(manifest["files"])
        return manifest
    except (OSError, ValueError, KeyError, TypeError):
        return None


def is_step_dir_name(name: str) -> bool:
    """True for ``global_step_N``."""
    return _STEP_DIR.fullmatch(name) is not None


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None when it is."""
    return _problem(Path(path))


def _problem(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None when it is."""
    if not path.is_dir():
        return f"{path} does not exist"
    manifest = _read_manifest(path)
    if manifest is None:
        return f"{path} has no readable {MARKER} marker (the save did not finish)"
    for name, size in manifest["files"].items():
        file = path / name
        try:
            actual = file.stat().st_size
        except OSError:
            return f"{file} is missing"
        if actual != size:
            return f"{file} has {actual} bytes, the manifest says {size}"
    return None


def verify_checkpoint(path: str | os.PathLike, *, content: bool = True) -> dict:
    """The manifest of a complete checkpoint folder; `CheckpointError` saying what is wrong otherwise.

    ``content``: also compare every file's sha256 with the manifest's (a same-size corruption is
    refused, not loaded); the cheap listing checks (`latest`, pruning) compare sizes only."""
    path = Path(path)
    problem = _problem(path)
    if problem is not None:
        raise CheckpointError(f"not a complete checkpoint: {problem}")
    manifest = _read_manifest(path)
    if content:
        for name, expected in manifest.get("sha256", {}).items():
            if _file_hash(path / name) != expected:
                raise CheckpointError(
                    f"checkpoint {path} is corrupt: {path / name} has the size the manifest records but not its "
                    "content (sha256 differs); resume from another checkpoint with trainer.resume_mode=resume_path "
                    "trainer.resume_from_path=<global_step_N>")
    return manifest


def safe_torch_load(path: Path) -> Any:
    """``torch.load(weights_only=True)``: tensors, numbers, strings and containers, never code."""
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"[^\n]*(?:unsupported (?:global: )?GLOBAL|Unsupported operand)[^\n]*", str(err), re.I)
        reason = (found[0] if found else str(err).splitlines()[0]).strip().rstrip(".")
        raise CheckpointError(f"refusing to load {path}: it holds Python objects, not just tensors and "
                              f"numbers ({reason}); only weights_only files are loaded") from None
    except Exception as err:  # truncated or foreign file
        raise CheckpointError(f"cannot read {path}: {err}") from err


def open_tensors(source: Path | str) -> Any:
    """A safetensors file opened to read one tensor at a time (``with open_tensors(p) as f: f.get_tensor(k)``),
    with pread(2) where safetensors has it (>= 0.8: no mapping whose pages stay resident); older versions map
    the file instead."""
    from safetensors import safe_open

    try:
        return safe_open(source, "pt", backend="pread")
    except TypeError:
        return safe_open(source, "pt")


def load_role(folder: str | os.PathLike, hf: bool = False) -> RoleState:
    """One role folder written by `write_role` (weights on CPU); ``hf`` also loads config and tokenizer."""
    return _load_role(Path(folder), hf)


def _load_role(folder: Path, hf: bool) -> RoleState:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        model = load_file(folder / MODEL_FILE, device="cpu")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"cannot read {folder / MODEL_FILE}: {err}") from err

    def optional(name: str) -> Any:
        return safe_torch_load(folder / name) if (folder / name).exists() else None

    role = RoleState(model=model, optimizer=optional(OPTIMIZER_FILE), scheduler=optional(SCHEDULER_FILE),
                     generator=optional(GENERATOR_FILE))
    hf_dir = folder / HF_DIR
    if hf and (hf_dir / "config.json").exists():
        from transformers import AutoConfig

        role.hf_config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=False)
    if hf and (hf_dir / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        role.tokenizer = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=False)
    return role


def load_checkpoint(path: str | os.PathLike, *, hf: bool = False) -> LoadedCheckpoint:
    """Load a complete ``global_step_N`` folder; ``hf=True`` also loads each role's config and tokenizer."""
    state = read_run_state(path)
    state.roles = {name: _load_role(state.path / name, hf) for name in state.roles}
    return state


def read_run_state(path: str | os.PathLike) -> LoadedCheckpoint:
    """A complete checkpoint's step, extra state and RNG states, without the weights: ``roles`` maps
    each saved role to its folder (the workers load their own, possibly sharded, state from it)."""
    path = Path(path)
    manifest = verify_checkpoint(path)
    try:
        extra = json.loads((path / EXTRA_FILE).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path / EXTRA_FILE}: {err}") from err
    rng = safe_torch_load(path / RNG_FILE) if (path / RNG_FILE).exists() else {}
    roles = {name: path / name for name in manifest["roles"]}
    return LoadedCheckpoint(path=path, step=int(manifest["step"]), roles=roles, extra=extra, rng=rng)


# ---------------------------------------------------------------------- rng
def capture_rng() -> dict[str, Any]:
    """python / numpy / torch (/ cuda) generator states as tensors and numbers (weights_only loadable)."""
    version, state, gauss_next = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    rng: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(state, dtype=torch.int64), "gauss_next": gauss_next},
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: Mapping[str, Any]) -> None:
    """Inverse of `capture_rng` (missing parts are left alone)."""
    if "python" in rng:
        py = rng["python"]
        random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    if "numpy" in rng:
        npy = rng["numpy"]
        np.random.set_state(("MT19937", npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                             npy["cached_gaussian"]))
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        if len(rng["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(rng["cuda"])
        else:
            logger.warning("checkpoint has CUDA rng states for %d devices, this machine has %d; not restored",
                           len(rng["cuda"]), torch.cuda.device_count())
