"""RayActorPool on a local 2-CPU Ray cluster: 2 CPU ranks with gloo. Ray starts once for the module
(~10 s on the 2-core machine) and each group start costs a few seconds (a process per rank that
imports torch), so the tests share one group and only the failure tests start their own."""

import datetime
import os
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from posttrain.config import ConfigError  # noqa: E402
from posttrain.distributed import cluster  # noqa: E402
from posttrain.distributed.cluster import ClusterResourceError, check_resources, connect  # noqa: E402
from posttrain.distributed.ray_pool import (RayActorPool, WorkerGroupError, assign_ranks,  # noqa: E402
                                            node_visible_devices)

# The test module is not importable inside Ray's worker processes: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")


class TinyWorker:
    """A worker as a real one is written: the constructor joins the process group from the environment
    the group set (torch's ``env://`` rendezvous, what ``fsdp.init_distributed`` uses too; that module
    imports transformers, seconds per rank here, so the test calls torch directly)."""

    def __init__(self, scale: float, *, tag: str = ""):
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
        self.rank, self.scale, self.tag = dist.get_rank(), scale, tag

    def env(self) -> dict:
        import torch

        return {**{k: os.environ.get(k) for k in _ENV_KEYS}, "threads": torch.get_num_threads(), "tag": self.tag}

    def scaled(self, x: float, offset: float = 0.0) -> float:
        return x * self.scale + offset

    def all_reduce(self, value: float) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    def shape_of(self, big) -> tuple:
        return tuple(big.shape)

    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"bad input on purpose, rank {rank}")
        return self.rank

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def exit_on(self, rank: int) -> float:
        """Rank ``rank``'s process exits mid-call while the other waits in a collective."""
        if self.rank == rank:
            time.sleep(0.5)
            os._exit(1)
        return self.all_reduce(1.0)


@pytest.fixture(scope="module")
def local_ray():
    connect({"address": "local", "num_cpus": 2}, "cpu")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def group(local_ray):
    g = RayActorPool(TinyWorker, (2.0,), {"tag": "t"}, nnodes=1, n_gpus_per_node=2, device="cpu")
    yield g
    g.shutdown()


def test_connect_again_is_a_no_op(local_ray):
    before = ray.get_runtime_context().get_job_id()
    connect({"num_cpus": 99}, "cpu")
    assert ray.get_runtime_context().get_job_id() == before


def test_resource_check_refuses_cuda_and_a_second_node_here(local_ray):
    """Before the shared group takes the 2 CPUs."""
    with pytest.raises(ClusterResourceError) as err:
        check_resources(1, 1, "cuda")
    assert isinstance(err.value, ConfigError)
    assert "trainer.device=cpu" in str(err.value) and "trainer.n_gpus_per_node" in str(err.value)
    with pytest.raises(ClusterResourceError, match=r"trainer.nnodes=2.*1 of 1 alive node.*trainer.nnodes to 1"):
        check_resources(2, 1, "cpu")
    assert cluster.resolve_device("auto") == "cpu"


def test_a_placement_that_cannot_happen_times_out_with_an_explanation(local_ray, monkeypatch):
    import posttrain.distributed.ray_pool as ray_group

    monkeypatch.setattr(ray_group, "check_resources", lambda *a: [])  # pretend the check passed
    start = time.monotonic()
    with pytest.raises(ClusterResourceError, match=r"did not place.*STRICT_PACK.*within 1 s.*ray status"):
        RayActorPool(TinyWorker, (1.0,), nnodes=1, n_gpus_per_node=3, device="cpu", placement_timeout_s=1)
    assert time.monotonic() - start < 15


def test_ranks_get_their_environment(group):
    envs = group.call_all("env")
    assert [e["RANK"] for e in envs] == ["0", "1"] and [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    for e in envs:
        assert e["WORLD_SIZE"] == "2" and e["LOCAL_WORLD_SIZE"] == "2" and e["tag"] == "t"
        assert e["MASTER_ADDR"] == group.master_addr == group.ranks[0].ip
        assert e["MASTER_PORT"] == str(group.master_port)
        assert e["OMP_NUM_THREADS"] == "1" and e["threads"] == 1
        assert e["TOKENIZERS_PARALLELISM"] == "false"  # the job env from connect reaches the ranks
    assert [r.rank for r in group.ranks] == [0, 1] and len({r.pid for r in group.ranks}) == 2


def test_call_all_and_call_each(group):
    assert group.call_all("scaled", 3.0, offset=1.0) == [7.0, 7.0]
    assert group.call_each("scaled", [1.0, 5.0], offset=0.5) == [2.5, 10.5]
    with pytest.raises(ValueError, match="3 per-rank arguments for 2 ranks"):
        group.call_each("scaled", [1.0, 2.0, 3.0])
    with pytest.raises(AttributeError, match="TinyWorker has no method 'scaledd'"):
        group.call_all("scaledd")


def test_a_big_argument_reaches_every_rank(group):
    import torch

    assert group.call_all("shape_of", torch.zeros(256, 1024)) == [(256, 1024), (256, 1024)]


def test_gloo_all_reduce_across_the_ranks(group):
    assert group.call_each("all_reduce", [1.0, 2.0]) == [3.0, 3.0]


def test_a_worker_error_names_rank_host_and_message(group):
    """Runs last among the users of the shared group: a failure shuts the group down."""
    with pytest.raises(WorkerGroupError) as err:
        group.call_all("fail_on", 1)
    e, info = err.value, group.ranks[1]
    assert (e.rank, e.method, e.host, e.ip) == (1, "fail_on", info.hostname, info.ip)
    msg = str(e)
    assert f"rank 1 (host {info.hostname}, ip {info.ip}" in msg
    assert "ValueError: bad input on purpose, rank 1" in msg and "in fail_on" in msg
    with pytest.raises(WorkerGroupError, match="shut down after an earlier failure"):
        group.call_all("scaled", 1.0)


def test_a_dying_rank_fails_the_call_within_seconds(local_ray):
    g = RayActorPool(TinyWorker, (1.0,), nnodes=1, n_gpus_per_node=2, device="cpu")
    start = time.monotonic()
    with pytest.raises(WorkerGroupError) as err:
        g.call_all("exit_on", 1)
    elapsed = time.monotonic() - start
    assert elapsed < 30, elapsed
    assert err.value.rank == 1 and "exit_on failed on rank 1" in str(err.value)
    assert "the process died" in str(err.value)


def test_a_call_past_its_time_limit_names_the_running_ranks(local_ray):
    g = RayActorPool(TinyWorker, (1.0,), nnodes=1, n_gpus_per_node=2, device="cpu", call_timeout_s=1)
    start = time.monotonic()
    with pytest.raises(WorkerGroupError, match=r"sleep did not finish within 1 s on rank 0 .*rank 1 "):
        g.call_all("sleep", 20)
    assert time.monotonic() - start < 10


def test_rank_order_and_gpu_visibility_on_two_gpu_nodes():
    """No GPU here: the numbering a 2-node x 2-GPU cluster would get, from made-up actor answers.
    Actors arrive in placement order; Ray packed the 'second node' group partly out of GPU order."""
    def actor(ip, node, gpu, pid):
        return {"ip": ip, "node_id": node, "hostname": f"h{node}", "pid": pid, "gpu_ids": (gpu,)}

    infos = [actor("10.0.0.10", "b", "3", 1), actor("10.0.0.10", "b", "1", 2),
             actor("10.0.0.9", "a", "6", 3), actor("10.0.0.9", "a", "0", 4)]
    order, ranks = assign_ranks(infos)
    assert order == [3, 2, 1, 0]  # node 10.0.0.9 first (numeric IP order), then GPU id
    assert [(r.rank, r.local_rank, r.local_world_size, r.gpu_ids) for r in ranks] == [
        (0, 0, 2, ("0",)), (1, 1, 2, ("6",)), (2, 0, 2, ("1",)), (3, 1, 2, ("3",))]
    assert node_visible_devices(ranks, "a") == "0,6" and node_visible_devices(ranks, "b") == "1,3"
