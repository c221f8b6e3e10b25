"""The worker boundary: every call the trainer makes on its workers, declared once, and the one-process group.

The trainer holds a `WorkerGroup` and nothing else of the workers. Each call takes and returns
plain batches, tensors, dicts of floats or paths, so the same calls can cross a process boundary:
`LocalWorkerGroup` runs the roles in this process (CPU or one GPU, no Ray needed),
`posttrain.distributed.RankWorkerGroup` runs them on many ranks through Ray, and
`posttrain.distributed.TorchrunGroup` on torchrun's ranks; `posttrain.distributed.RankWorker` is one
rank's side. The data calls are declared once, in `CALLS` (which role answers, how a batch is split
over ranks, which phase it is, whether the optimizer must be on the device), and `bind_calls` writes
each group's method for each of them from that row (verl's ``@register(dispatch_mode=...)``).

    generate_sequences(prompts, validate=False) -> Batch    rollout (n samples per prompt)
    compute_log_prob(batch) -> (old_log_probs, entropy)     actor, no grad      [N, R] each (calculate_sum_pi_squared=
                                                            True: a third, each token's sum of pi^2 over the vocabulary)
    compute_ref_log_prob(batch) -> ref_log_prob             reference policy    [N, R]
    compute_values(batch) -> values                         critic              [N, R]
    compute_rm_score(batch) -> rm_scores                    reward model        [N, R] (score on the last token)
    compute_teacher_log_prob(batch) -> (teacher_log_probs,  the teachers (distillation): [N, R], and for a top-k
        teacher_topk_ids, teacher_topk_log_probs)           loss mode [N, R, K] each (else None)
    compute_sequence_logps(batch) -> [N, 2]                 actor: per row, summed log-prob of its
                                                            response_mask tokens, and their count
    compute_ref_sequence_logps(batch) -> [N, 2]             the same under the reference (DPO)
    update_actor(batch, objective=None) -> metrics          the actor's update engine for an objective
                                                            (posttrain.algorithms.objectives: PPO by
                                                            default, SFT, DPO, SimPO)
    update_critic(batch) -> metrics                         PPO epochs on the critic
    memory_metrics() -> metrics                             ranks' peak resident memory per phase ({} in one process)
    save_checkpoint(folder) -> role names                   each role writes folder/<role>/, each rank
                                                            folder/rng/rank_<r>.pt (posttrain.checkpoint.rank_rng)
    load_checkpoint(folder)                                 each role reads folder/<role>/, each rank its RNG file
    mark_step() / rewind_step()                             each rank remembers its RNG state as a step begins /
                                                            goes back to it (the trainer undid the step)
    writes; agree_stop(stop) -> bool                        the rank rules of the run loop (posttrain.trainer.run):
                                                            whether this process logs, locks, saves and exports, and
                                                            whether the run stops (under torchrun: any rank's signal)
    shutdown()
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from posttrain.algorithms.objectives import Objective
from posttrain.batch import Batch
from posttrain.workers.build import Roles

__all__ = ["CALLS", "Call", "LocalWorkerGroup", "WorkerGroup", "bind_calls"]


@dataclass(frozen=True)
class Call:
    """One data call across the worker boundary.

    role: the role whose worker answers (``actor``, ``ref``, ``critic``, ``rm``).
    method: that worker's method.
    split: how a group cuts the batch over data-parallel ranks: ``prompts`` (each rank samples for
        its prompts), ``rows`` (results gathered back in the batch's order) or ``update`` (metrics
        combined; padding rows train nothing; an objective with ``pairs`` keeps pairs whole).
    phase: the trainer's stage name, under which a rank records its peak memory (None: not recorded).
    optimizer: the role's optimizer must be on the device (``optimizer_offload``) for the call.
    """

    role: str
    method: str
    split: str
    phase: str | None = None
    optimizer: bool = False


CALLS: dict[str, Call] = {
    "generate_sequences": Call("actor", "generate_sequences", "prompts", "gen"),
    "compute_log_prob": Call("actor", "compute_log_prob", "rows", "old_log_prob"),
    "compute_ref_log_prob": Call("ref", "compute_ref_log_prob", "rows", "ref"),
    "compute_values": Call("critic", "compute_values", "rows", "values"),
    "compute_rm_score": Call("rm", "compute_rm_score", "rows", "reward"),
    "compute_teacher_log_prob": Call("teachers", "compute_teacher_log_prob", "rows", "teacher"),
    "compute_sequence_logps": Call("actor", "compute_sequence_logps", "rows"),
    "compute_ref_sequence_logps": Call("ref", "compute_sequence_logps", "rows"),
    "update_actor": Call("actor", "train", "update", "update_actor", optimizer=True),
    "update_critic": Call("critic", "update_critic", "update", "update_critic", optimizer=True),
}


def bind_calls(cls: type) -> type:
    """Class decorator: a method for every call in `CALLS` that ``cls`` does not write itself, each
    forwarding to ``cls._dispatch(name, call, batch, **options)`` (``validate`` for generation,
    ``objective`` for ``update_actor``)."""
    for name, call in CALLS.items():
        if name not in cls.__dict__:
            setattr(cls, name, _forwarder(name, call))
    return cls


def _forwarder(name: str, call: Call) -> Callable[..., Any]:
    def method(self, batch: Batch, *args: Any, **options: Any) -> Any:
        if args:  # positional options (validate, objective) travel by name
            options[{"prompts": "validate", "update": "objective"}[call.split]] = args[0]
        return self._dispatch(name, call, batch, **options)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"`CALLS['{name}']`: {call.role}.{call.method}, split by {call.split}."
    return method


@runtime_checkable
class WorkerGroup(Protocol):
    """What the trainer may call on its workers (see the module docstring for shapes)."""

    world_size: int
    seed: int
    """The run's seed (each rank seeds its generators from it; a rank reseeded at resume too)."""
    has_ref: bool
    has_critic: bool
    has_rm: bool
    has_teacher: bool
    writes: bool
    """This process writes what one driver writes (tracker, checkpoint folder, export): all but torchrun's ranks > 0."""

    def agree_stop(self, stop: bool) -> bool: ...

    def generate_sequences(self, prompts: Batch, validate: bool = False) -> Batch: ...

    def compute_log_prob(self, batch: Batch, calculate_sum_pi_squared: bool = False) -> tuple[torch.Tensor, ...]: ...

    def compute_ref_log_prob(self, batch: Batch) -> torch.Tensor: ...

    def compute_values(self, batch: Batch) -> torch.Tensor: ...

    def compute_rm_score(self, batch: Batch) -> torch.Tensor: ...

    def compute_teacher_log_prob(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]: ...

    def compute_sequence_logps(self, batch: Batch) -> torch.Tensor: ...

    def compute_ref_sequence_logps(self, batch: Batch) -> torch.Tensor: ...

    def update_actor(self, batch: Batch, objective: Objective | None = None) -> dict[str, float]: ...

    def update_critic(self, batch: Batch) -> dict[str, float]: ...

    def save_checkpoint(self, folder: Path) -> list[str]: ...

    def load_checkpoint(self, folder: Path) -> None: ...

    def mark_step(self) -> None: ...

    def rewind_step(self) -> None: ...

    def memory_metrics(self) -> dict[str, float]: ...

    def shutdown(self) -> None: ...


@bind_calls
class LocalWorkerGroup:
    """The roles in this process: actor (with its hybrid rollout), optional reference, critic, reward model and
    teachers."""

    world_size = 1
    writes = True

    def __init__(self, actor: Any, ref: Any = None, critic: Any = None, rm: Any = None, seed: int = 0,
                 placement: Any = None, teachers: Any = None):
        self.actor, self.ref, self.critic, self.rm, self.seed = actor, ref, critic, rm, seed
        self.placement = placement
        self.roles = Roles(actor, ref, critic, rm, teachers)
        self.has_ref, self.has_critic, self.has_rm = ref is not None, critic is not None, rm is not None
        self.has_teacher = teachers is not None

    def _dispatch(self, name: str, call: Call, batch: Batch, **options: Any) -> Any:
        worker = getattr(self.roles, call.role)
        with self._resident(worker, call):
            return getattr(worker, call.method)(batch, **options)

    def _resident(self, worker: Any, call: Call) -> contextlib.AbstractContextManager:
        """The placement's residency for the call (paged state in, freed heap out), when it has one."""
        resident = getattr(self.placement, "resident", None)
        if resident is None:
            return contextlib.nullcontext()
        return resident(worker, with_optimizer=call.optimizer, phase=call.phase)

    def save_checkpoint(self, folder: Path) -> list[str]:
        """Each role's folder, and this process's random state as rank 0's (``rng/rank_0.pt``), so a run
        of several ranks resumed from it continues rank 0's streams."""
        from posttrain.checkpoint.rank_rng import role_generators, save_rank_rng

        roles = self.roles.trained()
        for name, worker in roles.items():
            worker.save_checkpoint(Path(folder) / name)
        save_rank_rng(folder, 0, role_generators(roles))
        return list(roles)

    def load_checkpoint(self, folder: Path) -> str:
        """Each role's state, then rank 0's saved random state (`posttrain.checkpoint.rank_rng`)."""
        from posttrain.checkpoint.rank_rng import load_rank_rng, role_generators

        roles = self.roles.trained()
        for name, worker in roles.items():
            worker.load_checkpoint(Path(folder) / name)
        return load_rank_rng(folder, 0, 1, role_generators(roles), self.seed)

    def mark_step(self) -> None:
        """The roles' shuffle generators as the step begins (the trainer rewinds the process's own)."""
        from posttrain.checkpoint.rank_rng import role_generators

        self._step_generators = {name: g.get_state() for name, g in role_generators(self.roles.trained()).items()}

    def rewind_step(self) -> None:
        from posttrain.checkpoint.rank_rng import role_generators

        for name, generator in role_generators(self.roles.trained()).items():
            generator.set_state(self._step_generators[name])

    def memory_metrics(self) -> dict[str, float]:
        """Nothing beyond the trainer's own ``memory/*``: the roles run in its process."""
        return {}

    def agree_stop(self, stop: bool) -> bool:
        return stop

    def shutdown(self) -> None:
        """Nothing to stop in one process."""
