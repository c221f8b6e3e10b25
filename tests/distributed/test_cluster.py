"""Per-node resource checks against made-up clusters (no Ray started); the checks against the real
local cluster are in test_ray_pool.py, where Ray runs."""

import pytest

from posttrain.config import ConfigError
from posttrain.distributed import cluster
from posttrain.distributed.cluster import ClusterResourceError, NodeResources, check_resources, ip_sort_key


def node(ip: str, gpus: float, cpus: float, free_gpus: float | None = None, free_cpus: float | None = None):
    return NodeResources(node_id=f"id-{ip}", ip=ip, hostname=f"host-{ip.rsplit('.', 1)[-1]}",
                         free_gpu=gpus if free_gpus is None else free_gpus, total_gpu=gpus,
                         free_cpu=cpus if free_cpus is None else free_cpus, total_cpu=cpus)


@pytest.fixture
def nodes(monkeypatch):
    """Replace Ray's view of the cluster with a list the test fills in."""
    fake: list[NodeResources] = []
    monkeypatch.setattr(cluster, "live_nodes", lambda: list(fake))
    return fake


def test_enough_nodes_pass_and_are_returned(nodes):
    nodes += [node("10.0.0.1", 8, 64), node("10.0.0.2", 8, 64)]
    assert [n.ip for n in check_resources(2, 8, "cuda", cpus_per_rank=3)] == ["10.0.0.1", "10.0.0.2"]


def test_a_missing_node_is_named_with_the_keys(nodes):
    nodes += [node("10.0.0.1", 8, 64)]
    with pytest.raises(ClusterResourceError) as err:
        check_resources(2, 8, "cuda")
    msg = str(err.value)
    assert isinstance(err.value, ConfigError) and "\n" not in msg
    for part in ("trainer.nnodes=2", "trainer.n_gpus_per_node=8", "trainer.device", "1 of 1 alive node(s) fit",
                 "host-1 (10.0.0.1): 8/8 GPU, 64/64 CPU free", "start Ray on 1 more node(s)"):
        assert part in msg, (part, msg)


def test_the_check_is_per_node_not_a_cluster_total(nodes):
    # 8 GPUs free in total, but no single node has the 8 a STRICT_PACK group needs (verl checks the total)
    nodes += [node("10.0.0.1", 8, 64, free_gpus=4), node("10.0.0.2", 8, 64, free_gpus=4)]
    with pytest.raises(ClusterResourceError, match=r"0 of 2 alive node\(s\) fit.*4/8 GPU.*4/8 GPU.*ray status"):
        check_resources(1, 8, "cuda")


def test_cpus_of_gpu_bundles_are_checked_too(nodes):
    nodes += [node("10.0.0.1", 8, 16, free_cpus=10)]
    check_resources(1, 8, "cuda", cpus_per_rank=1)
    with pytest.raises(ClusterResourceError, match=r"8 free GPU\(s\) and 16 CPU\(s\)"):
        check_resources(1, 8, "cuda", cpus_per_rank=2)


def test_cuda_on_a_cpu_only_cluster_suggests_cpu_ranks(nodes):
    nodes += [node("10.0.0.1", 0, 2)]
    with pytest.raises(ClusterResourceError, match="Ray sees no GPU on any node: set trainer.device=cpu"):
        check_resources(1, 1, "cuda")
    check_resources(1, 2, "cpu")
    with pytest.raises(ClusterResourceError, match=r"4 free CPU\(s\) \(2 rank\(s\) x 2 CPU\)"):
        check_resources(1, 2, "cpu", cpus_per_rank=2)


def test_auto_device_follows_the_cluster_and_bad_values_are_config_errors(nodes):
    nodes += [node("10.0.0.1", 0, 2)]
    assert cluster.resolve_device("auto") == "cpu"
    nodes.append(node("10.0.0.2", 1, 2))
    assert cluster.resolve_device("auto") == "cuda" and cluster.resolve_device("cpu") == "cpu"
    with pytest.raises(ConfigError, match="trainer.device='tpu'"):
        cluster.resolve_device("tpu")
    with pytest.raises(ClusterResourceError, match="trainer.nnodes=0"):
        check_resources(0, 1, "cpu")


def test_node_descriptions_are_capped_and_ips_sort_numerically():
    many = [node(f"10.0.0.{i}", 0, 1) for i in range(12)]
    text = cluster.describe_nodes(many, limit=3)
    assert text.count("CPU free") == 3 and text.endswith("and 9 more nodes")
    assert sorted(["10.0.0.10", "10.0.0.9", "name"], key=ip_sort_key) == ["10.0.0.9", "10.0.0.10", "name"]


def test_job_environment_keeps_user_values():
    env = cluster._with_job_env({"env_vars": {"NCCL_DEBUG": "INFO"}, "pip": ["x"]}, "cpu")
    assert env["pip"] == ["x"]
    assert env["env_vars"] == {"TOKENIZERS_PARALLELISM": "false", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "1"}
    assert "OMP_NUM_THREADS" not in cluster._with_job_env(None, "cuda")["env_vars"]
