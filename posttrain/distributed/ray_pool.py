"""``RayActorPool``: ``W = nnodes * n_gpus_per_node`` Ray actors, one per device, each hosting one
instance of a user-supplied worker class; calls go to every rank and results come back in rank order.

Placement (verl's ``RayResourcePool``): one placement group per node, ``STRICT_PACK``, with one
bundle per rank (``{"GPU": 1, "CPU": c}``, or ``{"CPU": c}`` on CPU). Ranks are numbered by node
(nodes sorted by IP), then by GPU id within a node, so ``LOCAL_RANK`` is the rank's index in the
node's ``CUDA_VISIBLE_DEVICES``. All ranks on a node see all of that node's ranks' GPUs (Ray
Train's ``share_cuda_visible_devices``; Ray's default one-GPU-per-actor masking is reported to slow
down or break NCCL's intra-node paths, NVIDIA-NeMo/RL#2252), and each rank uses ``cuda:LOCAL_RANK``.

Start-up, per actor: (1) the actor starts empty and reports its node, host name and GPU ids;
(2) ranks are assigned and rank 0's actor picks a free port; (3) ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and ``CUDA_VISIBLE_DEVICES``)
are written into the actor's environment and only then is ``worker_cls(*args, **kwargs)``
constructed there, so the worker's constructor can join the process group with
``posttrain.distributed.fsdp.init_distributed()``, which reads them.

A hosted worker class: ``__init__(*args, **kwargs)`` (the same arguments on every rank) learns its
rank from ``os.environ["RANK"]`` (or ``torch.distributed`` once joined) and uses ``cuda:LOCAL_RANK``
(``torch.cuda.set_device`` does that in ``init_distributed``); its public methods take and return
picklable values (``Batch``, tensors on CPU, dicts, floats); a method that raises fails the group.

Waiting never blocks blindly: results are collected with ``ray.wait`` in short rounds. A rank whose
process dies or whose method raises fails the call within a round: the whole group is killed (its
peers would otherwise hang in a collective until the NCCL/gloo timeout, 10 minutes by default) and
:class:`WorkerGroupError` names the rank, its host and IP, the method and the rank's error.
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Any, Sequence

from posttrain.errors import PosttrainError
from posttrain.distributed.cluster import (ClusterResourceError, bundle_for, check_resources, describe_nodes,
                                           free_port, free_resources_per_node, ip_sort_key)

__all__ = ["RankInfo", "RayActorPool", "WorkerGroupError", "assign_ranks", "node_visible_devices"]

_POLL_S = 1.0  # how often a waiting driver wakes to check the overall call timeout


class WorkerGroupError(PosttrainError, RuntimeError):
    """A rank failed; ``rank``, ``host``, ``ip``, ``method`` and ``detail`` say where and how. The
    command line prints the message as one ``error:`` line (it already names the rank's error and the
    file and line that raised it; ``--debug`` adds the driver's traceback) and exits with 1."""

    def __init__(self, message: str, *, rank: int | None = None, host: str = "?", ip: str = "?",
                 method: str = "?", detail: str = ""):
        super().__init__(message)
        self.rank, self.host, self.ip, self.method, self.detail = rank, host, ip, method, detail


@dataclass(frozen=True)
class RankInfo:
    """Where one rank runs."""

    rank: int
    local_rank: int
    local_world_size: int
    node_id: str
    ip: str
    hostname: str
    pid: int
    gpu_ids: tuple[str, ...]


# ------------------------------------------------------------------------------------------ in the actor
class _RankHost:
    """The Ray actor: holds one worker instance and runs its methods by name.

    Kept free of torch/CUDA work until :meth:`start`, so CUDA is first touched after
    ``CUDA_VISIBLE_DEVICES`` has been set for the node.
    """

    def __init__(self):
        self.worker = None

    def describe(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        gpu_ids = ctx.get_accelerator_ids().get("GPU", [])
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "hostname": socket.gethostname(), "pid": os.getpid(), "gpu_ids": tuple(str(g) for g in gpu_ids)}

    def free_port(self) -> int:
        """A TCP port free on this node now (the OS picks it; the rendezvous binds it moments later)."""
        return free_port()

    def start(self, env: dict[str, str], num_threads: int | None, constructor: tuple[type, tuple, dict]) -> None:
        worker_cls, args, kwargs = constructor
        os.environ.update(env)
        if num_threads:
            import torch

            torch.set_num_threads(num_threads)
        self.worker = worker_cls(*args, **kwargs)

    def execute(self, method: str, shared: tuple[tuple, dict], *own: Any) -> Any:
        """``worker.method(*own, *args, **kwargs)`` with ``(args, kwargs) = shared``."""
        if self.worker is None:
            raise RuntimeError(f"no worker to run {method!r} on: the worker was not constructed")
        args, kwargs = shared
        return getattr(self.worker, method)(*own, *args, **kwargs)


# ------------------------------------------------------------------------------------------ on the driver
class RayActorPool:
    """``nnodes * n_gpus_per_node`` ranks, each an actor hosting ``worker_cls(*args, **kwargs)``.

    Args:
        worker_cls: the class to construct in every rank (importable or picklable by Ray).
        args, kwargs: its constructor arguments, the same for every rank (``ray.put`` once); a rank
            learns its rank from ``os.environ["RANK"]`` etc. or from ``torch.distributed`` after init.
        nnodes, n_gpus_per_node: ``trainer.nnodes`` / ``trainer.n_gpus_per_node`` (ranks per node,
            CPU ranks included).
        device: ``cuda`` or ``cpu`` (resolve ``auto`` with ``cluster.resolve_device`` first).
        cpus_per_rank: CPUs in each rank's bundle; CPU ranks also get that many torch threads.
        placement_timeout_s: how long the placement groups may take to be placed
            (``trainer.ray_wait_register_center_timeout``); then a ``ClusterResourceError`` explains.
        call_timeout_s: optional limit on every ``call_all``/``call_each`` (``None``: wait as long as all
            ranks are alive). Start-up is not limited by it: the worker constructor's own rendezvous
            timeout covers a hang there.
        env: extra environment variables for every rank.

    Ray must be initialised (``cluster.connect``). The resources are checked per node before
    anything is created (``cluster.check_resources``).
    """

    def __init__(self, worker_cls: type, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None, *,
                 nnodes: int = 1, n_gpus_per_node: int = 1, device: str = "cpu", cpus_per_rank: int = 1,
                 placement_timeout_s: float = 300.0, call_timeout_s: float | None = None,
                 env: dict[str, str] | None = None):
        check_resources(nnodes, n_gpus_per_node, device, cpus_per_rank)
        self.device, self.cpus_per_rank = device, cpus_per_rank
        self.call_timeout_s = call_timeout_s
        self.world_size = nnodes * n_gpus_per_node
        self._actors: list[Any] = []
        self._pgs: list[Any] = []
        self._failed: WorkerGroupError | None = None
        self._worker_cls = worker_cls
        self.ranks: list[RankInfo] = []
        self.master_addr, self.master_port = "", 0
        try:
            self._place(nnodes, n_gpus_per_node, placement_timeout_s)
            self._assign_ranks()
            self._start_workers(worker_cls, tuple(args), dict(kwargs or {}), dict(env or {}))
        except BaseException:
            self.shutdown()
            raise

    # ---------------------------------------------------------------- start-up
    def _place(self, nnodes: int, per_node: int, timeout_s: float) -> None:
        """One STRICT_PACK placement group per node, then one actor per bundle."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = bundle_for(self.device, self.cpus_per_rank)
        self._pgs = [placement_group([dict(bundle) for _ in range(per_node)], strategy="STRICT_PACK")
                     for _ in range(nnodes)]
        ready, _ = ray.wait([pg.ready() for pg in self._pgs], num_returns=nnodes, timeout=timeout_s)
        if len(ready) < nnodes:  # Ray would wait forever; say why instead
            raise ClusterResourceError(self._placement_timeout_message(nnodes, per_node, bundle, timeout_s))
        host = ray.remote(_RankHost)
        env_vars = {"OMP_NUM_THREADS": str(self.cpus_per_rank)} if self.device == "cpu" else {}
        for pg in self._pgs:
            for i in range(per_node):
                self._actors.append(host.options(
                    num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0, max_task_retries=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                    runtime_env={"env_vars": env_vars},
                ).remote())

    def _placement_timeout_message(self, nnodes: int, per_node: int, bundle: dict, timeout_s: float) -> str:
        from ray.util import placement_group_table

        states = sorted({placement_group_table(pg).get("stats", {}).get("scheduling_state", "?") for pg in self._pgs})
        return (f"Ray did not place the {nnodes} placement group(s) of {per_node} x {bundle} (STRICT_PACK: each "
                f"group on ONE node) within {timeout_s:g} s (trainer.ray_wait_register_center_timeout); Ray's "
                f"scheduling state: {', '.join(states)} (INFEASIBLE: no node can hold a group). The check before "
                f"placing passed, so another job or a node leaving took the resources. Now: [{describe_nodes()}]. "
                f"Check `ray status`, or change trainer.nnodes, trainer.n_gpus_per_node or trainer.device.")

    def _assign_ranks(self) -> None:
        """Number the actors (see :func:`assign_ranks`); rank 0's actor picks the rendezvous port."""
        infos = self._wait([a.describe.remote() for a in self._actors], "describe", ranked=False)
        order, self.ranks = assign_ranks(infos)
        self._actors = [self._actors[i] for i in order]
        self.master_addr = self.ranks[0].ip
        self.master_port = self._wait([self._actors[0].free_port.remote()], "free_port")[0]

    def _rank_env(self, info: RankInfo, extra: dict[str, str]) -> dict[str, str]:
        env = {**extra, "RANK": str(info.rank), "WORLD_SIZE": str(self.world_size),
               "LOCAL_RANK": str(info.local_rank), "LOCAL_WORLD_SIZE": str(info.local_world_size),
               "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}
        if self.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = node_visible_devices(self.ranks, info.node_id)
        return env

    def _start_workers(self, worker_cls: type, args: tuple, kwargs: dict, extra_env: dict[str, str]) -> None:
        import ray

        constructor = ray.put((worker_cls, args, kwargs))  # once, however many ranks
        threads = self.cpus_per_rank if self.device == "cpu" else None
        refs = [actor.start.remote(self._rank_env(info, extra_env), threads, constructor)
                for actor, info in zip(self._actors, self.ranks)]
        self._wait(refs, f"{getattr(worker_cls, '__name__', worker_cls)}.__init__")

    # ---------------------------------------------------------------- calls
    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method(*args, **kwargs)`` on every rank (verl's ONE_TO_ALL); results in rank order.
        The arguments are stored in Ray's object store once and shared by all ranks."""
        import ray

        self._check_usable(method)
        shared = ray.put((args, kwargs))
        return self._wait([a.execute.remote(method, shared) for a in self._actors], method,
                          timeout_s=self.call_timeout_s)

    def call_each(self, method: str, per_rank_args: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``method(per_rank_args[r], *args, **kwargs)`` on rank ``r`` (e.g. its batch chunk); the
        common ``args``/``kwargs`` are stored once. Results in rank order."""
        import ray

        self._check_usable(method)
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"call_each({method!r}) got {len(per_rank_args)} per-rank arguments for "
                             f"{self.world_size} ranks")
        shared = ray.put((args, kwargs))
        # a top-level ObjectRef argument reaches the method as its value; big per-rank arguments
        # are moved through the object store by Ray itself
        refs = [a.execute.remote(method, shared, x) for a, x in zip(self._actors, per_rank_args)]
        return self._wait(refs, method, timeout_s=self.call_timeout_s)

    def _check_usable(self, method: str) -> None:
        if self._failed is not None:
            raise WorkerGroupError(f"cannot call {method!r}: the worker group was shut down after an earlier "
                                   f"failure ({self._failed})", rank=self._failed.rank, method=method)
        if not self._actors:
            raise WorkerGroupError(f"cannot call {method!r}: the worker group is shut down", method=method)
        cls = self._worker_cls  # a typo fails here, before it would take the group down
        if not hasattr(cls, "__getattr__") and not callable(getattr(cls, method, None)):
            raise AttributeError(f"{cls.__name__} has no method {method!r}")

    # ---------------------------------------------------------------- waiting
    def _wait(self, refs: list[Any], method: str, ranked: bool = True, timeout_s: float | None = None) -> list[Any]:
        """Results of ``refs`` (one per rank, or per actor before ranks exist: ``ranked=False``) in
        order; on the first failure, or after ``timeout_s``, kill the group and raise."""
        import ray

        pending = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        start = time.monotonic()
        while pending:
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_POLL_S)
            failures = []
            for ref in done:
                i = pending.pop(ref)
                try:
                    results[i] = ray.get(ref)
                except Exception as err:  # noqa: BLE001 - every remote failure is reported the same way
                    failures.append((i, err))
            if failures:
                self._fail(method, failures, ranked)
            if timeout_s is not None and pending and time.monotonic() - start > timeout_s:
                self._fail_timeout(method, sorted(pending.values()), timeout_s)
        return results

    def _fail(self, method: str, failures: list[tuple[int, Exception]], ranked: bool) -> None:
        import ray

        # a vanished process is the likeliest cause of its peers' errors in the same round
        failures.sort(key=lambda f: (not isinstance(f[1], ray.exceptions.RayActorError), f[0]))
        lines = [self._where(i, ranked) + ": " + _error_text(err) for i, err in failures]
        i, err = failures[0]
        info = self.ranks[i] if ranked and i < len(self.ranks) else None
        message = f"{method} failed on " + lines[0] + "".join(f"\n  also: {x}" for x in lines[1:])
        message += f"\nThe worker group ({self.world_size} ranks) was shut down."
        error = WorkerGroupError(message, rank=info.rank if info else None, host=info.hostname if info else "?",
                                 ip=info.ip if info else "?", method=method, detail=_error_text(err))
        self.shutdown()
        self._failed = error
        raise error from err

    def _fail_timeout(self, method: str, running: list[int], timeout_s: float) -> None:
        where = ", ".join(self._where(i, True) for i in running)
        error = WorkerGroupError(f"{method} did not finish within {timeout_s:g} s on {where} "
                                 f"(a hang in a collective, or a slow rank); the worker group was shut down",
                                 rank=running[0], method=method)
        self.shutdown()
        self._failed = error
        raise error

    def _where(self, i: int, ranked: bool) -> str:
        if not ranked or i >= len(self.ranks):
            return f"actor {i}"
        r = self.ranks[i]
        return f"rank {r.rank} (host {r.hostname}, ip {r.ip}, pid {r.pid})"

    # ---------------------------------------------------------------- end
    def shutdown(self) -> None:
        """Kill the actors and free their placement groups (idempotent). Returns once Ray reports the
        resources free again (at most a few seconds), so a new group can be placed right away."""
        import ray
        from ray.util.placement_group import remove_placement_group

        held = _held_per_node(self._pgs)
        before = free_resources_per_node() if held else {}
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        for pg in self._pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already removed is fine
                pass
        self._actors, self._pgs = [], []
        await_released(held, before)

    def __enter__(self) -> "RayActorPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


# ------------------------------------------------------------------------------------------ helpers
def assign_ranks(infos: Sequence[dict[str, Any]]) -> tuple[list[int], list[RankInfo]]:
    """``(order, ranks)`` from the actors' ``describe()`` answers: ``order[r]`` is the actor that
    becomes rank ``r``. Ranks go by node (IP order), then GPU id, then creation order; local ranks
    count within the actual node, which also holds when Ray packed two "nodes'" groups onto one."""
    order = sorted(range(len(infos)), key=lambda i: (ip_sort_key(infos[i]["ip"]), infos[i]["node_id"],
                                                     _gpu_key(infos[i]["gpu_ids"]), i))
    by_node: dict[str, list[int]] = {}
    for rank, i in enumerate(order):
        by_node.setdefault(infos[i]["node_id"], []).append(rank)
    ranks = []
    for rank, i in enumerate(order):
        info, peers = infos[i], by_node[infos[i]["node_id"]]
        ranks.append(RankInfo(rank=rank, local_rank=peers.index(rank), local_world_size=len(peers),
                              node_id=info["node_id"], ip=info["ip"], hostname=info["hostname"], pid=info["pid"],
                              gpu_ids=tuple(info["gpu_ids"])))
    return order, ranks


def node_visible_devices(ranks: Sequence[RankInfo], node_id: str) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the ranks of ``node_id``: their GPUs in local-rank order, so that
    rank ``r`` finds its own GPU at ``cuda:LOCAL_RANK``."""
    return ",".join(g for r in ranks if r.node_id == node_id for g in r.gpu_ids)


def _held_per_node(pgs: list[Any]) -> dict[str, dict[str, float]]:
    """``{node_id: resources}`` the placed bundles of ``pgs`` hold."""
    from ray.util import placement_group_table

    held: dict[str, dict[str, float]] = {}
    for pg in pgs:
        table = placement_group_table(pg)
        for index, node in (table.get("bundles_to_node_id") or {}).items():
            if not node:  # bundle never placed
                continue
            for name, amount in table["bundles"][index].items():
                held.setdefault(node, {}).setdefault(name, 0.0)
                held[node][name] += amount
    return held


def await_released(held: dict[str, dict[str, float]], before: dict[str, dict[str, float]],
                    timeout_s: float = 10.0) -> None:
    """Wait until each node's free resources have grown by what the group held. Ray releases them
    asynchronously (after the actor processes exit), and a group created right after a shutdown
    would otherwise find them still taken. Gives up silently after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while held and time.monotonic() < deadline:
        free = free_resources_per_node()
        if all(free.get(node, {}).get(name, 0.0) >= before.get(node, {}).get(name, 0.0) + amount - 1e-6
               for node, res in held.items() for name, amount in res.items()):
            return
        time.sleep(0.05)


def _gpu_key(gpu_ids: Sequence[str]) -> tuple:
    return tuple(int(g) if str(g).isdigit() else 10**9 for g in gpu_ids)


def _error_text(err: BaseException) -> str:
    """The remote error in a few lines: the exception line of the rank's traceback and where it was
    raised, or why Ray says the process died."""
    import ray

    if isinstance(err, ray.exceptions.RayTaskError):
        cause = err.cause if isinstance(err.cause, BaseException) else None
        head = f"{type(cause).__name__}: {cause}" if cause is not None else str(err).strip().splitlines()[-1]
        frames = [ln.strip() for ln in str(err).splitlines() if ln.strip().startswith('File "')]
        return head + (f" ({frames[-1]})" if frames else "")
    if isinstance(err, ray.exceptions.RayActorError):
        found = re.search(r"Worker exit type: (\S+) Worker exit detail: (.*?\.)(?:\s|$)", str(err))
        why = f"{found.group(1)}: {found.group(2)}" if found else str(err).strip().splitlines()[0]
        return (f"the process died ({why}); likely the OOM killer (`dmesg` on that node, `ray memory`), a "
                f"crash, or an exit in the worker code; its output is in the Ray worker logs "
                f"(/tmp/ray/session_latest/logs on that node)")
    return f"{type(err).__name__}: {err}"
