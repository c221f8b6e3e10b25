"""Each rank's random state in a checkpoint: ``global_step_N/rng/rank_<r>.pt``, one file per rank.

Every rank samples from generators of its own: the global torch generator (CPU, and CUDA on a GPU),
seeded ``trainer.seed + rank`` when the rank starts, which draws the rollout's responses (the ``hf``
engine's sampling, an in-process vLLM engine's sampler), Python's ``random`` and numpy's, and each
trained role's mini-batch shuffle generator. A rank writes all of them into its own file while it
writes its shards, inside the checkpoint's temporary folder, so the file is sealed (fsynced, listed
in the manifest with its sha256) and renamed into place with the rest of the checkpoint. The
driver's own ``rng_state.pt`` is restored first, then each rank restores its own file, so in one
process (where driver and rank 0 share the generators) rank 0's state is the one that holds.

At the world size that saved the checkpoint every rank continues its own streams exactly. At
another world size (`rank_rng_plan`, printed by the driver with `describe_rank_rng_plan`):

- a rank below the saved world size restores that rank's saved state;
- a rank at or above it has no saved state: its generators are reseeded from
  ``(trainer.seed, rank, step)`` (`fresh_seed`: reproducible, a hash rather than ``trainer.seed + r``,
  so it does not replay the first steps of the rank that started with that seed); its roles' shuffle
  generators keep the state their role folder holds (rank 0's);
- the saved states of ranks beyond the new world size are not used.

A step the trainer undoes (a signal while rewards are computed) must not leave the ranks' streams
advanced by its rollout, since the checkpoint saved next is the previous step's: each rank
remembers its state as a step begins and goes back to it (``WorkerGroup.mark_step`` /
``rewind_step``, with `capture_rank_rng` / `restore_rank_rng`).

A checkpoint written before these files existed holds none: resumed in one process, the driver's
``rng_state.pt`` (that process's state) is restored as before and nothing is reseeded; on several
ranks every rank is reseeded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from posttrain.checkpoint.layout import CheckpointError, _read_manifest, capture_rng, restore_rng, safe_torch_load

__all__ = ["RANK_RNG_DIR", "RankRngPlan", "capture_rank_rng", "checkpoint_step", "describe_rank_rng_plan", "fresh_seed",
           "load_rank_rng", "rank_rng_file", "rank_rng_plan", "restore_rank_rng", "role_generators", "save_rank_rng",
           "saved_rank_count"]

RANK_RNG_DIR = "rng"
_RANK_FILE = re.compile(r"rank_(\d+)\.pt")


def rank_rng_file(step_dir: str | Path, rank: int) -> Path:
    return Path(step_dir) / RANK_RNG_DIR / f"rank_{int(rank)}.pt"


def role_generators(roles: Mapping[str, Any]) -> dict[str, torch.Generator]:
    """Each role's mini-batch shuffle generator (what a role holds as ``generator``), by role name."""
    return {name: role.generator for name, role in roles.items() if getattr(role, "generator", None) is not None}


def save_rank_rng(step_dir: str | Path, rank: int, generators: Mapping[str, torch.Generator]) -> Path:
    """Write this process's generator states and the roles' ``generators`` (role name -> generator) into
    ``step_dir/rng/rank_<rank>.pt`` (tensors and numbers only: loadable with ``weights_only``)."""
    path = rank_rng_file(step_dir, rank)
    path.parent.mkdir(exist_ok=True)  # every rank of the group writes into the same folder
    torch.save(capture_rank_rng(generators), path)
    return path


def capture_rank_rng(generators: Mapping[str, torch.Generator]) -> dict[str, Any]:
    """This process's generator states and the roles' ``generators`` (role name -> generator)."""
    return {"process": capture_rng(), "generators": {name: g.get_state() for name, g in generators.items()}}


def restore_rank_rng(state: Mapping[str, Any], generators: Mapping[str, torch.Generator]) -> None:
    """Inverse of `capture_rank_rng`; a role the state does not hold (one the saving run did not
    train) keeps its generator."""
    restore_rng(state["process"])
    for name, generator in generators.items():
        if name in state["generators"]:
            generator.set_state(state["generators"][name])


def saved_rank_count(step_dir: str | Path) -> int:
    """How many ranks wrote their state into ``step_dir`` (0 for a checkpoint without ``rng/``).
    A checkpoint whose files are not exactly ``rank_0 .. rank_{W-1}`` is refused, naming the folder."""
    folder = Path(step_dir) / RANK_RNG_DIR
    if not folder.is_dir():
        return 0
    ranks = sorted(int(m[1]) for p in folder.iterdir() if (m := _RANK_FILE.fullmatch(p.name)))
    if ranks != list(range(len(ranks))) or not ranks:
        raise CheckpointError(f"{folder} holds the RNG states of ranks {ranks}; a checkpoint holds one file per "
                              "rank of the run that saved it, rank_0.pt to rank_<W-1>.pt")
    return len(ranks)


def fresh_seed(seed: int, rank: int, step: int) -> int:
    """The seed of a rank that has no saved state, from the run's seed, its rank and the resumed step."""
    return int(np.random.SeedSequence([int(seed) % 2**32, int(rank), int(step)]).generate_state(1)[0])


@dataclass(frozen=True)
class RankRngPlan:
    """What each rank of a resumed run does with the checkpoint's per-rank RNG states."""

    saved_world: int
    world: int

    @property
    def restored(self) -> list[int]:
        return list(range(min(self.saved_world, self.world)))

    @property
    def reseeded(self) -> list[int]:
        if self.saved_world == 0 and self.world == 1:  # an older one-process checkpoint: rng_state.pt is its state
            return []
        return list(range(self.saved_world, self.world))

    @property
    def unused(self) -> list[int]:
        return list(range(self.world, self.saved_world))


def rank_rng_plan(saved_world: int, world: int) -> RankRngPlan:
    return RankRngPlan(int(saved_world), int(world))


def describe_rank_rng_plan(plan: RankRngPlan, seed: int, step: int) -> str | None:
    """The console line for a resume at another world size than the one that saved (None when the
    same: every rank continues its own streams)."""
    if not plan.reseeded and not plan.unused:
        return None
    if plan.saved_world == 0:
        head = ("the checkpoint holds no per-rank RNG state (saved before posttrain wrote rng/rank_<r>.pt) and "
                f"resumes on {_count(plan.world)}")
    else:
        head = f"the checkpoint was saved by {_count(plan.saved_world)} and resumes on {_count(plan.world)}"
    parts = [head]
    if plan.restored:
        one = len(plan.restored) == 1
        parts.append(f"{_ranks(plan.restored)} {'continues its' if one else 'continue their'} own saved RNG state")
    if plan.reseeded:
        one = len(plan.reseeded) == 1
        seeds = ", ".join(f"rank {r}: {fresh_seed(seed, r, step)}" for r in plan.reseeded)
        parts.append(f"{_ranks(plan.reseeded)} {'has' if one else 'have'} no saved state and {'is' if one else 'are'} "
                     f"reseeded from (trainer.seed={seed}, rank, step={step}) ({seeds}): "
                     f"{'its' if one else 'their'} sampled responses differ from any uninterrupted run")
    if plan.unused:
        parts.append(f"the saved state of {_ranks(plan.unused)} is not used")
    return "note: " + "; ".join(parts)


def _count(world: int) -> str:
    return f"{world} rank" if world == 1 else f"{world} ranks"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def load_rank_rng(step_dir: str | Path, rank: int, world: int, generators: Mapping[str, torch.Generator],
                  seed: int, step: int | None = None) -> str:
    """Restore this rank's state from ``step_dir`` (see the module docstring for another world size);
    returns ``"restored"``, ``"reseeded"`` or ``"kept"`` (an older one-process checkpoint). ``step``
    (for a fresh seed): default the checkpoint's (`checkpoint_step`)."""
    plan = rank_rng_plan(saved_rank_count(step_dir), world)
    if rank in plan.restored:
        state = safe_torch_load(rank_rng_file(step_dir, rank))
        _restore(state, generators, rank_rng_file(step_dir, rank))
        return "restored"
    if rank in plan.reseeded:
        _reseed(fresh_seed(seed, rank, checkpoint_step(step_dir) if step is None else step))
        return "reseeded"
    return "kept"


def checkpoint_step(step_dir: str | Path) -> int:
    """The step a checkpoint folder holds: its manifest's, else its ``global_step_N`` name's, else 0
    (a folder of role states written outside a `CheckpointManager`, as tests do)."""
    manifest = _read_manifest(Path(step_dir))
    if manifest is not None:
        return int(manifest["step"])
    named = re.fullmatch(r"global_step_(\d+)", Path(step_dir).name)
    return int(named[1]) if named else 0


def _restore(state: Any, generators: Mapping[str, torch.Generator], path: Path) -> None:
    try:
        restore_rank_rng(state, generators)
    except (KeyError, TypeError, RuntimeError, ValueError) as err:
        raise CheckpointError(f"{path} is not a rank's RNG state ({type(err).__name__}: {err})") from err


def _reseed(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device's generator
