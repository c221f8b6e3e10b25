"""The rollout pool of asynchronous runs (``actor_rollout_ref.hybrid_engine=False``): Ray actors that only
generate, each on its own device or (on CPU) its own share of cores, apart from the trainer.

Each `RolloutWorker` builds the actor's model and engine from the run's config exactly as the trainer
does (`posttrain.workers.build.build_roles`, actor role only: LoRA runs keep a LoRA-injected copy), so
version 0 (the initial weights) is the trainer's without a push. It never trains. A work unit (a prompt
batch) comes back as the engine's Batch with ``rollout_log_probs`` and ``meta_info["weight_version"]``, the
version its weights had when the unit started. Weights arrive through `posttrain.distributed.weight_sync`
on a second thread of the actor (Ray concurrency group ``sync``): they are copied aside and loaded at the
next unit boundary, so a push never waits for a generation to finish and no unit mixes two versions.

Faults: a worker that dies or raises fails the driver's next wait (rounds of one second) with one
`RolloutWorkerError` line naming the worker (index, node IP, pid) and Ray's error. Each worker on the
driver's host watches the driver's pid and exits when it is gone (a kill -9 leaves no orphan worker).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from posttrain.errors import PosttrainError

__all__ = ["RolloutPool", "RolloutWorker", "RolloutWorkerError", "cpu_share"]

_POLL_S = 1.0  # the driver's wait rounds: a dead worker is noticed within one round
_WATCH_S = 1.0  # how often a worker checks that the driver is alive
_SYNC = "sync"  # the actor's concurrency group for weight pushes


class RolloutWorkerError(PosttrainError, RuntimeError):
    """A rollout worker died or raised; the message names it and Ray's error."""


def cpu_share(total_cpus: int, trainer_ranks: int, rollout_workers: int) -> int:
    """Cores per process when the trainer's ranks and the rollout workers split ``total_cpus`` evenly."""
    return max(1, total_cpus // max(1, trainer_ranks + rollout_workers))


# ------------------------------------------------------------------------------------------ in the actor
def _process_alive(pid: int) -> bool:
    """False once ``pid`` has exited (a zombie waiting for its parent counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _watch_driver(pid: int) -> None:
    while _process_alive(pid):
        time.sleep(_WATCH_S)
    os._exit(0)  # the driver is gone: nothing will consume this worker's samples


class RolloutWorker:
    """Hosted in a Ray actor: the actor's model and engine, generating only.

    Args:
        config: the run's `PostTrainConfig`.
        index: this worker's number in the pool (its engine samples with seed ``trainer.seed + 1 + index``).
        driver: (hostname, pid) of the driver; watched when this worker runs on the same host.
        num_threads: torch threads (this worker's CPU share).
        device: ``cpu`` or ``cuda``.
    """

    def __init__(self, config: Any, index: int, driver: tuple[str, int], num_threads: int, device: str):
        import torch

        torch.set_num_threads(num_threads)
        if driver[0] == socket.gethostname():
            threading.Thread(target=_watch_driver, args=(driver[1],), daemon=True, name="watch-driver").start()
        self.index, self.version, self.lora_only = index, 0, False
        self.actor = _build_actor(config, device, index)
        self.lora_only = self.actor.lora is not None
        if config.async_training.partial_rollout and hasattr(self.actor.rollout, "pause_point"):
            self.actor.rollout.pause_point = self._apply_pending  # pushes land between two decoding steps
        torch.manual_seed(config.trainer.seed + 1 + index)
        self._lock = threading.Lock()
        self._pending: tuple[dict, int] | None = None
        self._group = None
        self._started, self._busy_s = time.perf_counter(), 0.0

    def describe(self) -> dict[str, Any]:
        import ray

        gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        return {"index": self.index, "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "hostname": socket.gethostname(), "gpu_ids": [str(g) for g in gpus]}

    def generate(self, prompts: Any) -> Any:
        """The engine's responses to ``prompts`` (single- or multi-turn, as the config says), tagged
        with the weight version they were generated with and this worker's busy/wall seconds."""
        start = time.perf_counter()
        self._apply_pending()
        first = self.version
        batch = self.actor.generate_sequences(prompts)
        self._busy_s += time.perf_counter() - start
        # a partial rollout may have taken a push mid-way: the unit's age is that of its first tokens
        batch.meta_info.update(weight_version=first, weight_version_end=self.version, rollout_worker=self.index,
                               rollout_busy_s=self._busy_s, rollout_wall_s=time.perf_counter() - self._started)
        return batch

    def join_sync(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        from posttrain.distributed.weight_sync import WeightSyncGroup

        self._group = WeightSyncGroup.create(host, port, 1 + self.index, world_size, backend=backend,
                                             timeout_s=timeout_s)

    def receive_weights(self) -> int:
        """Take one push (runs beside a generation): checked by `weight_sync.stage_weights` as it arrives (a
        wrong name or shape fails the push, reported to the trainer), loaded at the next unit boundary."""
        from posttrain.distributed.weight_sync import stage_weights

        received: dict[str, Any] = {}

        def stash(named) -> None:
            received.update(stage_weights(self.actor.module, named, lora_only=self.lora_only))

        version = self._group.receive(stash)
        with self._lock:
            self._pending = (received, version)
        return version

    def _apply_pending(self) -> bool:
        """Load the last push received, if any (True). At a unit's start, or between two decoding steps with
        partial rollouts (`HFRolloutEngine.pause_point`: the engine then prefills its running rows again)."""
        from posttrain.distributed.weight_sync import load_weights

        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return False
        load_weights(self.actor.module, iter(pending[0].items()), lora_only=self.lora_only)
        self.actor.refresh_generation_weights()  # LoRA merged for a generation under way follows the adapters
        self.actor.weights_version += 1  # an engine with its own copy (vllm) reloads before generating
        self.version = pending[1]
        return True

    def weights(self) -> dict[str, Any]:
        """This worker's current weights (pending pushes applied first), for checks."""
        self._apply_pending()
        return {k: v.detach().cpu().clone() for k, v in self.actor.module.state_dict().items()}

    def log_probs(self, batch: Any) -> Any:
        """Log-probs of ``batch``'s responses under this worker's weights (pending pushes applied first)."""
        self._apply_pending()
        return self.actor.compute_log_prob(batch, calculate_entropy=False)[0]


def _build_actor(config: Any, device: str, index: int) -> Any:
    """The actor role alone, built and placed as the trainer builds its own (LoRA included); the worker says
    its own role where the trainer says its memory plan (`rollout_placement`)."""
    import torch

    from posttrain.config import derive_sizes, worker_config
    from posttrain.config.roles import RoleSpecs, rl_role_specs
    from posttrain.workers.build import build_roles

    specs = RoleSpecs(actor=rl_role_specs(worker_config(config, derive_sizes(config))).actor)
    place = rollout_placement(torch.device(device), index, specs)
    roles = build_roles(specs, place, config.trainer.seed)
    place.settle(roles)
    return roles.actor


def rollout_placement(device: Any, index: int, specs: Any) -> Any:
    """The trainer's one-process placement (`InProcess`: the same levers on the weights, the same process-wide
    memory policy), whose one console line is this worker's role: a trainer's memory plan (its optimizer's
    moments, its reference) would describe state a rollout worker never uses. ``specs``: the roles it holds, whose
    config sets its host levers (`HostLevers`)."""
    from posttrain.distributed.placement import HostLevers, InProcess

    class RolloutPlacement(InProcess):
        def announce_plan(self) -> None:
            print(f"rollout worker {index}: generates with the actor's weights on {self.device.type}, updated by the "
                  "trainer's pushes; trains nothing (no optimizer step, no reference); its memory counts in the "
                  "run's process-tree peak", flush=True)

    return RolloutPlacement(device, HostLevers.of(specs))


# ------------------------------------------------------------------------------------------ on the driver
@dataclass
class _Unit:
    seq: int
    tag: Any
    worker: int
    ref: Any
    result: Any = None
    done: bool = False


@dataclass
class _WorkerInfo:
    index: int
    ip: str = "?"
    pid: int = -1
    gpu_ids: list = field(default_factory=list)
    last: tuple[float, float] = (0.0, 0.0)  # (busy_s, wall_s) last reported
    window: list[float] = field(default_factory=lambda: [0.0, 0.0])  # busy, wall since the last metrics()


class RolloutPool:
    """``count`` rollout workers; units are taken back in submission order.

    Args:
        config: the run's config (each worker builds its actor from it).
        count: workers (``rollout.nnodes x rollout.n_gpus_per_node``).
        device: ``cpu`` or ``cuda`` (one GPU per worker).
        cpus_per_worker: each worker's CPU share (its torch and OpenMP threads).
        start_timeout_s: how long building the workers may take.
    Ray must be initialised (`posttrain.distributed.cluster.connect`).
    """

    def __init__(self, config: Any, count: int, device: str, cpus_per_worker: int, start_timeout_s: float = 600):
        import ray

        env = {"OMP_NUM_THREADS": str(cpus_per_worker), "MKL_NUM_THREADS": str(cpus_per_worker)}
        remote = ray.remote(concurrency_groups={_SYNC: 1})(RolloutWorker).options(
            num_cpus=cpus_per_worker, num_gpus=1 if device == "cuda" else 0, max_restarts=0,
            runtime_env={"env_vars": env})
        driver = (socket.gethostname(), os.getpid())
        self.device, self.units, self._seq = device, {}, 0
        self._share = {"CPU": float(cpus_per_worker), **({"GPU": 1.0} if device == "cuda" else {})}
        self.workers = [remote.remote(config, i, driver, cpus_per_worker, device) for i in range(count)]
        self.info = [_WorkerInfo(i) for i in range(count)]
        self.group = None
        described = self._get([w.describe.remote() for w in self.workers], "start", timeout_s=start_timeout_s)
        for d in described:
            info = self.info[d["index"]]
            info.ip, info.pid, info.gpu_ids = d["ip"], d["pid"], d["gpu_ids"]

    # ---------------------------------------------------------------- weights
    def connect_weights(self, source: Any, timeout_s: float = 600) -> None:
        """Join the trainer's sender (rank 0 of the weight-sync group) and the workers (ranks 1..k).
        ``source`` as for `push`: the actor's module (this process sends) or the trainer's ranks (their rank 0)."""
        import ray

        from posttrain.distributed.cluster import free_port
        from posttrain.distributed.weight_sync import WeightSyncGroup

        sender = source if hasattr(source, "push_weights") else None  # the ranks, as `push` tells them apart
        host, port = sender.weight_sync_address() if sender is not None else (ray.util.get_node_ip_address(),
                                                                              free_port())
        world, backend = 1 + len(self.workers), "nccl" if self.device == "cuda" else "gloo"
        refs = [w.join_sync.options(concurrency_group=_SYNC).remote(host, port, world, backend, timeout_s)
                for w in self.workers]
        try:
            if sender is None:
                self.group = WeightSyncGroup.create(host, port, 0, world, backend=backend, timeout_s=timeout_s)
            else:
                sender.join_weight_sync(host, port, world, backend, timeout_s)
        except Exception:
            self._name_failed_worker(refs, "join the weight-sync group")
            raise
        self._get(refs, "join the weight-sync group")

    def push(self, source: Any, version: int, lora_only: bool) -> dict[str, float]:
        """Send the trainer's weights (the LoRA adapter alone with ``lora_only``) as ``version`` to every worker.
        ``source``: the actor's module in this process, or the trainer's ranks (`RankWorkerGroup.push_weights`)."""
        from posttrain.distributed.ray_pool import WorkerGroupError
        from posttrain.distributed.weight_sync import push_trainer_weights

        refs = [w.receive_weights.options(concurrency_group=_SYNC).remote() for w in self.workers]
        try:
            if hasattr(source, "push_weights"):
                metrics = source.push_weights(version, lora_only)
            else:
                metrics = push_trainer_weights(self.group, source, version, lora_only=lora_only)
        except WorkerGroupError:
            raise  # a trainer rank failed (the workers' receive failing after it is its effect): it names the rank
        except Exception:
            self._name_failed_worker(refs, "receive weights")  # a dead worker is the cause: say which
            raise
        self._get(refs, "receive weights")
        return metrics

    def _name_failed_worker(self, refs: list, what: str, wait_s: float = 10.0) -> None:
        """Raise `RolloutWorkerError` for the first of ``refs`` that failed within ``wait_s``, if any."""
        import ray

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as err:  # noqa: BLE001 - named and re-raised
                raise RolloutWorkerError(self._failure(refs.index(ref), what, err)) from None

    # ---------------------------------------------------------------- work
    def submit(self, prompts: Any, tag: Any) -> int:
        """Start a unit on the worker with the fewest units in flight; returns its sequence number."""
        loads = [0] * len(self.workers)
        for unit in self.units.values():
            loads[unit.worker] += 0 if unit.done else 1
        worker = min(range(len(loads)), key=loads.__getitem__)
        seq, self._seq = self._seq, self._seq + 1
        self.units[seq] = _Unit(seq, tag, worker, self.workers[worker].generate.remote(prompts))
        return seq

    @property
    def in_flight(self) -> int:
        return len(self.units)

    def oldest_tag(self) -> Any:
        return self.units[min(self.units)].tag if self.units else None

    def take(self, seq: int | None = None) -> tuple[Any, Any, float]:
        """(Batch, tag, seconds waited) of unit ``seq`` (default: the oldest submitted); fails fast,
        naming the worker, if any worker failed meanwhile."""
        seq = min(self.units) if seq is None else seq
        start = time.perf_counter()
        while not self.units[seq].done:
            self._collect(timeout_s=_POLL_S)
        unit = self.units.pop(seq)
        return unit.result, unit.tag, time.perf_counter() - start

    def discard_all(self) -> None:
        """Forget the units in flight (their results are ignored when they arrive)."""
        self.units.clear()

    def _collect(self, timeout_s: float) -> None:
        import ray

        pending = {u.ref: u for u in self.units.values() if not u.done}
        if not pending:
            return
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout_s)
        if ready:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        for ref in ready:
            unit = pending[ref]
            unit.result = self._get([ref], "generate")[0]
            unit.done = True
            self._account(unit.worker, unit.result.meta_info)

    def _account(self, index: int, meta: dict) -> None:
        info = self.info[index]
        busy, wall = meta["rollout_busy_s"], meta["rollout_wall_s"]
        info.window[0] += busy - info.last[0]
        info.window[1] += wall - info.last[1]
        info.last = (busy, wall)

    def metrics(self) -> dict[str, float]:
        """rollouter/idle_ratio: the share of the workers' time without a unit, since the last call."""
        busy = sum(i.window[0] for i in self.info)
        wall = sum(i.window[1] for i in self.info)
        for i in self.info:
            i.window = [0.0, 0.0]
        return {"rollouter/idle_ratio": max(0.0, 1 - busy / wall)} if wall > 0 else {}

    # ---------------------------------------------------------------- checks and end
    def call(self, index: int, method: str, *args: Any) -> Any:
        """``method(*args)`` on worker ``index`` (tests and checks)."""
        return self._get([getattr(self.workers[index], method).remote(*args)], method)[0]

    def _get(self, refs: list, what: str, timeout_s: float | None = None) -> list:
        import ray

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        remaining = list(refs)
        while remaining:
            ready, remaining = ray.wait(remaining, num_returns=len(remaining), timeout=_POLL_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as err:  # noqa: BLE001 - named and re-raised below
                    raise RolloutWorkerError(self._failure(refs.index(ref) if what != "generate" else
                                                           self._unit_worker(ref), what, err)) from None
            if remaining and deadline is not None and time.monotonic() > deadline:
                raise RolloutWorkerError(f"rollout workers did not {what} within {timeout_s:.0f} s")
        return ray.get(list(refs))

    def _unit_worker(self, ref: Any) -> int:
        return next((u.worker for u in self.units.values() if u.ref == ref), 0)

    def _failure(self, index: int, what: str, err: BaseException) -> str:
        from posttrain.distributed.ray_pool import _error_text

        info = self.info[index] if index < len(self.info) else _WorkerInfo(index)
        return (f"rollout worker {index} (node {info.ip}, pid {info.pid}) failed to {what}: "
                f"{' '.join(_error_text(err).split())}")

    def shutdown(self) -> None:
        """Kill the workers (idempotent). Returns once Ray reports the CPUs (GPUs) of the workers that were
        alive free again (at most a few seconds), so a pool or trainer started right after finds them."""
        import ray

        from posttrain.distributed.cluster import free_resources_per_node
        from posttrain.distributed.ray_pool import await_released

        held = self._held_by_live_workers()
        before = free_resources_per_node() if held else {}
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass
        self.workers, self.units = [], {}
        if self.group is not None:
            try:
                self.group.close()
            except Exception:  # noqa: BLE001 - the peers are gone
                pass
            self.group = None
        await_released(held, before)

    def _held_by_live_workers(self) -> dict[str, dict[str, float]]:
        """``{node_id: resources}`` of the workers Ray still has alive: a worker that died earlier has
        already given its share back, and waiting for it again would stall the error path."""
        from ray._private import state  # the GCS actor table, as `free_resources_per_node` reads it

        held: dict[str, dict[str, float]] = {}
        for worker in self.workers:
            entry = state.actors(worker._actor_id.hex()) or {}
            if entry.get("State") != "ALIVE":
                continue
            node = held.setdefault(entry["Address"]["NodeID"], {})
            for name, amount in self._share.items():
                node[name] = node.get(name, 0.0) + amount
        return held


