"""Joining or starting Ray, and checking per node that the ranks fit before anything is created.

verl checks only the cluster-wide GPU total ("Total available GPUs 8 is less than total desired
GPUs 16", verl#2515) and otherwise lets placement groups wait forever. Here every node is checked
against what one node's placement group needs (``STRICT_PACK``: all of a node's bundles on ONE
node), and a shortfall is a :class:`ClusterResourceError` (a ``ConfigError``, so the CLI prints it
as one line) naming each node's free resources, as ``ray status`` shows them, and the keys to change.

Ray is imported inside the functions: the one-process path never needs it installed.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Optional

from posttrain.config import ConfigError
from posttrain.distributed.reaper import start_reaper
from posttrain.host.process_tree import start_run_peak

__all__ = [
    "ClusterResourceError",
    "ClusterUnreachableError",
    "NodeResources",
    "RayTarget",
    "bundle_for",
    "check_resources",
    "choose_cluster",
    "connect",
    "gcs_answers",
    "describe_nodes",
    "free_resources_per_node",
    "ip_sort_key",
    "live_nodes",
    "resolve_device",
]

logger = logging.getLogger(__name__)

# Environment of every process Ray starts for this job. Tokenizers' own thread pool deadlocks or
# warns after a fork; NCCL only speaks up when something is wrong. Users' values win.
_JOB_ENV = {"TOKENIZERS_PARALLELISM": "false", "NCCL_DEBUG": "WARN"}

# ray.init arguments that describe a NEW cluster; Ray refuses them when joining a running one.
_LOCAL_ONLY_KWARGS = ("num_cpus", "num_gpus", "resources", "object_store_memory", "include_dashboard",
                      "dashboard_host", "dashboard_port", "labels")

_FIX_KEYS = "trainer.nnodes, trainer.n_gpus_per_node or trainer.device"


class ClusterResourceError(ConfigError):
    """The Ray cluster cannot hold the requested ranks; the message names nodes and keys."""


class ClusterUnreachableError(ConfigError):
    """The Ray cluster the user named (``ray_kwargs.ray_init.address``, ``RAY_ADDRESS``) does not answer.
    Raised at once: ``ray.init`` on a dead address retries for minutes without saying why."""



CLEAN_UP = "`ray stop --force` ends the Ray processes left on this machine (every Ray cluster of this user here)"


# ------------------------------------------------------------------------------------------ connect
def connect(ray_init_kwargs: dict[str, Any] | None = None, device: str = "cpu") -> None:
    """Join a running Ray cluster or start a local one; a no-op when Ray is already initialised.

    ``ray_init_kwargs`` are verl's ``ray_kwargs.ray_init.*`` (``None`` values are left out) and go to
    ``ray.init``. Without an ``address``: the cluster in ``RAY_ADDRESS`` or one started with ``ray start``
    on this machine is joined (arguments that only describe a new cluster, such as ``num_cpus``, are
    then dropped with a warning); otherwise a local cluster is started, without the dashboard unless
    ``include_dashboard`` is given. ``address="local"`` always starts a new one.
    ``device`` is ``cpu`` or ``cuda``; CPU ranks get ``OMP_NUM_THREADS`` from their bundle size (see
    ``ray_pool``), not from here.
    """
    import ray

    if ray.is_initialized():
        return
    kwargs = {k: v for k, v in (ray_init_kwargs or {}).items() if v is not None}
    kwargs["runtime_env"] = _with_job_env(kwargs.get("runtime_env"), device)
    target = choose_cluster(kwargs.pop("address", None), os.environ.get("RAY_ADDRESS") or None,
                            _recorded_address(kwargs.get("_temp_dir")), gcs_answers)
    if target.note:
        logger.warning(target.note)
    address = target.address
    if address == "local":
        kwargs.setdefault("include_dashboard", False)
        ray.init(address="local", **kwargs)
        start_reaper()  # the cluster this run started ends with it, even after kill -9 (reaper.py)
        start_run_peak()  # its ranks are this process's descendants: the run's memory line counts them
        return
    dropped = sorted(k for k in _LOCAL_ONLY_KWARGS if k in kwargs)
    if dropped:
        logger.warning("joining a running Ray cluster: ignoring ray_kwargs.ray_init %s (fixed when the cluster "
                    "was started with `ray start`)", dropped)
    ray.init(address=address, **{k: v for k, v in kwargs.items() if k not in dropped})


@dataclass(frozen=True)
class RayTarget:
    address: str
    """What ``ray.init`` gets: ``local`` (start a new cluster for this run) or the cluster to join."""
    note: Optional[str] = None
    """A warning for the log (a recorded cluster that is gone), else None."""


def choose_cluster(requested: Optional[str], env_address: Optional[str], recorded: Optional[tuple[str, str]],
                   answers: Callable[[str], bool]) -> RayTarget:
    """Which cluster this run uses; never one that does not answer.

    ``requested``: ``ray_kwargs.ray_init.address``; ``env_address``: ``RAY_ADDRESS``; ``recorded``:
    ``(address, file)`` that the last ``ray start`` on this machine wrote (``/tmp/ray/ray_current_cluster``),
    or None; ``answers(address)``: whether a GCS listens there. A cluster the user named explicitly must
    answer (else `ClusterUnreachableError`, at once). A recorded cluster that is gone (its processes
    killed, or stopped without ``ray stop``, which would have removed the file) is skipped with a note:
    the run starts its own local cluster. Processes that outlived a killed driver's own local cluster
    need nothing: ``ray.init`` never records those, so a new run starts a fresh cluster beside them.
    Unlike Ray's ``address="auto"``, nothing here joins a stranger's ``ray.init`` cluster.
    """
    if requested == "local":
        return RayTarget("local")
    if requested is not None:
        _must_answer(requested, "ray_kwargs.ray_init.address", answers,
                     "start it (`ray start --head` on its head node) or leave the key unset to start a local cluster")
        return RayTarget(requested)
    if env_address is not None:
        _must_answer(env_address, "RAY_ADDRESS", answers,
                     "start it (`ray start --head` on its head node) or unset RAY_ADDRESS to start a local cluster")
        return RayTarget(env_address)
    if recorded is None:
        return RayTarget("local")
    address, path = recorded
    if answers(address):
        return RayTarget(address)
    return RayTarget("local", f"the Ray cluster that `ray start` recorded in {path} ({address}) does not answer: its "
                              f"processes are gone; starting a new local cluster for this run instead. {CLEAN_UP}.")


def _must_answer(address: str, source: str, answers: Callable[[str], bool], fix: str) -> None:
    if _host_port(address) is not None and not answers(address):
        raise ClusterUnreachableError(f"{source}={address}: no Ray cluster answers there; {fix}. If a killed run left "
                                      f"Ray processes behind, {CLEAN_UP}.")


def _host_port(address: str) -> Optional[tuple[str, int]]:
    """``(host, port)`` of a plain ``host:port`` address; None for ``auto``, ``ray://...`` and the like,
    which are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or "/" in address or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def free_port() -> int:
    """A TCP port free on this node now, on every interface (the OS picks it; a rendezvous binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def gcs_answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts a TCP connection at the GCS address (a live cluster does at once;
    a dead one refuses or times out)."""
    host_port = _host_port(address)
    if host_port is None:
        return True
    try:
        with socket.create_connection(host_port, timeout=timeout_s):
            return True
    except OSError:
        return False


def _recorded_address(temp_dir: Optional[str]) -> Optional[tuple[str, str]]:
    """``(address, file)`` of the cluster the last ``ray start`` here recorded, or None (the file
    ``ray.init`` itself reads for ``address=None``)."""
    from ray._private import utils as ray_utils

    address = ray_utils.read_ray_address(temp_dir)
    return (address, ray_utils.get_ray_address_file(temp_dir)) if address else None


def _with_job_env(runtime_env: Any, device: str) -> dict[str, Any]:
    """``ray_kwargs.ray_init.runtime_env`` for ``ray.init``: a null entry is left out (verl's
    ``py_executable: null`` means this interpreter, Ray's default), the job's environment variables added."""
    env = {k: v for k, v in dict(runtime_env or {}).items() if v is not None}
    env_vars = dict(_JOB_ENV)
    if device == "cpu":  # ranks set their own thread count; stray helper processes stay at one
        env_vars["OMP_NUM_THREADS"] = "1"
    env_vars.update(env.get("env_vars") or {})
    env["env_vars"] = env_vars
    return env


# ------------------------------------------------------------------------------------------ nodes
@dataclass(frozen=True)
class NodeResources:
    """One alive Ray node: free and total GPUs and CPUs, as ``ray status`` counts them."""

    node_id: str
    ip: str
    hostname: str
    free_gpu: float
    total_gpu: float
    free_cpu: float
    total_cpu: float

    def describe(self) -> str:
        return (f"{self.hostname} ({self.ip}): {_num(self.free_gpu)}/{_num(self.total_gpu)} GPU, "
                f"{_num(self.free_cpu)}/{_num(self.total_cpu)} CPU free")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def ip_sort_key(ip: str) -> tuple:
    """Sort key putting IPs in numeric order (10.0.0.9 before 10.0.0.10), names after."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return (9, 0, ip)
    return (addr.version, int(addr), "")


def live_nodes() -> list[NodeResources]:
    """Alive nodes sorted by IP, with free resources from Ray's per-node availability."""
    import ray

    free = free_resources_per_node()
    nodes = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        total = n.get("Resources", {})
        avail = free.get(n["NodeID"], {})  # every live node is listed (its node:<ip> resource)
        nodes.append(NodeResources(
            node_id=n["NodeID"], ip=n.get("NodeManagerAddress", "?"), hostname=n.get("NodeManagerHostname", "?"),
            free_gpu=avail.get("GPU", 0.0), total_gpu=total.get("GPU", 0.0),
            free_cpu=avail.get("CPU", 0.0), total_cpu=total.get("CPU", 0.0)))
    return sorted(nodes, key=lambda n: (ip_sort_key(n.ip), n.node_id))


def free_resources_per_node() -> dict[str, dict[str, float]]:
    """``{node_id: free resources}``; a resource with nothing free is absent (Ray's convention)."""
    from ray._private import state  # Ray's DeveloperAPI behind `ray status`; no public equivalent

    return state.available_resources_per_node()


def describe_nodes(nodes: list[NodeResources] | None = None, limit: int = 8) -> str:
    """``host (ip): free/total GPU, free/total CPU`` for each node, ``; ``-separated, at most ``limit``."""
    nodes = live_nodes() if nodes is None else nodes
    if not nodes:
        return "no alive nodes"
    parts = [n.describe() for n in nodes[:limit]]
    if len(nodes) > limit:
        parts.append(f"and {len(nodes) - limit} more nodes")
    return "; ".join(parts)


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when any alive node has GPUs (the driver's own machine may have none)."""
    if device in ("cpu", "cuda"):
        return device
    if device != "auto":
        raise ConfigError(f"trainer.device={device!r}: expected cuda, cpu or auto")
    return "cuda" if any(n.total_gpu > 0 for n in live_nodes()) else "cpu"


# ------------------------------------------------------------------------------------------ check
def bundle_for(device: str, cpus_per_rank: float) -> dict[str, float]:
    """One rank's placement-group bundle: a GPU plus its CPUs, or CPUs only."""
    return {"GPU": 1.0, "CPU": float(cpus_per_rank)} if device == "cuda" else {"CPU": float(cpus_per_rank)}


def _fits(node: NodeResources, ranks: int, bundle: dict[str, float]) -> bool:
    return node.free_gpu >= ranks * bundle.get("GPU", 0.0) and node.free_cpu >= ranks * bundle["CPU"]


def check_resources(nnodes: int, n_gpus_per_node: int, device: str, cpus_per_rank: float = 1) -> list[NodeResources]:
    """Raise :class:`ClusterResourceError` unless at least ``nnodes`` alive nodes each have room for
    ``n_gpus_per_node`` rank bundles (one GPU + ``cpus_per_rank`` CPUs each on ``cuda``, or
    ``cpus_per_rank`` CPUs on ``cpu``). Returns the nodes that fit. Call it before creating anything.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"check_resources needs device cpu or cuda (resolve 'auto' first), got {device!r}")
    if nnodes < 1 or n_gpus_per_node < 1:
        raise ClusterResourceError(f"trainer.nnodes={nnodes} and trainer.n_gpus_per_node={n_gpus_per_node} "
                                   f"must both be >= 1")
    nodes = live_nodes()
    bundle = bundle_for(device, cpus_per_rank)
    fitting = [n for n in nodes if _fits(n, n_gpus_per_node, bundle)]
    if len(fitting) >= nnodes:
        return fitting
    raise ClusterResourceError(_shortfall_message(nnodes, n_gpus_per_node, device, cpus_per_rank, nodes, fitting))


def _shortfall_message(nnodes: int, per_node: int, device: str, cpus_per_rank: float,
                       nodes: list[NodeResources], fitting: list[NodeResources]) -> str:
    need = (f"{per_node} free GPU(s) and {_num(per_node * cpus_per_rank)} CPU(s)" if device == "cuda"
            else f"{_num(per_node * cpus_per_rank)} free CPU(s) ({per_node} rank(s) x {_num(cpus_per_rank)} CPU)")
    have = f"{len(fitting)} of {len(nodes)} alive node(s) fit"
    fix = [f"change {_FIX_KEYS}"]
    if device == "cuda" and not any(n.total_gpu for n in nodes):
        fix.insert(0, "Ray sees no GPU on any node: set trainer.device=cpu to run the ranks on CPUs "
                      "(gloo), or start Ray where GPUs are visible")
    elif len(nodes) < nnodes:
        fix.insert(0, f"start Ray on {nnodes - len(nodes)} more node(s) (`ray start --address=<head-ip>:6379`) "
                      f"or lower trainer.nnodes to {len(nodes)}")
    else:
        fix.insert(0, "free resources held by other Ray jobs (see `ray status`)")
    return (f"Ray cannot place trainer.nnodes={nnodes} x trainer.n_gpus_per_node={per_node} ranks on "
            f"trainer.device={device}: each node needs {need}, and {have} [{describe_nodes(nodes)}]. "
            f"Fix: {'; or '.join(fix)}.")
