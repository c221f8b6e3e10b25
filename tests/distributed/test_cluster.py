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


# ---------------------------------------------------------------- which cluster a run joins or starts
def _answers(*alive):
    return lambda address: address in alive


DEAD, LIVE = "10.0.0.9:6379", "10.0.0.1:6379"
RECORDED_FILE = "/tmp/ray/ray_current_cluster"


def test_no_cluster_anywhere_starts_a_local_one():
    assert cluster.choose_cluster(None, None, None, _answers()) == cluster.RayTarget("local")


def test_a_live_recorded_cluster_is_joined_and_a_dead_one_is_skipped_with_a_note():
    assert cluster.choose_cluster(None, None, (LIVE, RECORDED_FILE), _answers(LIVE)).address == LIVE
    target = cluster.choose_cluster(None, None, (DEAD, RECORDED_FILE), _answers(LIVE))
    assert target.address == "local"
    assert f"recorded in {RECORDED_FILE} ({DEAD}) does not answer" in target.note and "ray stop --force" in target.note


def test_a_named_cluster_that_does_not_answer_is_one_error_at_once():
    with pytest.raises(cluster.ClusterUnreachableError, match=rf"^RAY_ADDRESS={DEAD}: no Ray cluster answers there;.*"
                                                              "unset RAY_ADDRESS.*ray stop --force"):
        cluster.choose_cluster(None, DEAD, (LIVE, RECORDED_FILE), _answers(LIVE))
    with pytest.raises(ConfigError, match=rf"ray_kwargs.ray_init.address={DEAD}: no Ray cluster answers"):
        cluster.choose_cluster(DEAD, None, None, _answers(LIVE))
    # live ones are joined; the explicit key wins over RAY_ADDRESS, which wins over the recorded file
    assert cluster.choose_cluster(LIVE, DEAD, None, _answers(LIVE)).address == LIVE
    assert cluster.choose_cluster(None, LIVE, (DEAD, RECORDED_FILE), _answers(LIVE)) == cluster.RayTarget(LIVE)
    # "local" starts a new cluster whatever else exists; forms that are not host:port are left to Ray
    assert cluster.choose_cluster("local", DEAD, (DEAD, RECORDED_FILE), _answers()).address == "local"
    assert cluster.choose_cluster("ray://10.0.0.9:10001", None, None, _answers()).address == "ray://10.0.0.9:10001"


def test_gcs_answers_only_where_something_listens():
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert cluster.gcs_answers(f"127.0.0.1:{port}")
    # the same port once closed: refused (negative control)
    assert not cluster.gcs_answers(f"127.0.0.1:{port}", timeout_s=1)


def test_connect_starts_its_own_cluster_beside_a_dead_recorded_one(monkeypatch, caplog):
    # Ray itself is replaced: the test checks what connect hands to ray.init, not Ray.
    ray = pytest.importorskip("ray")
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "_recorded_address", lambda temp_dir: ("127.0.0.1:1", RECORDED_FILE))
    cluster.connect({"num_cpus": 1}, "cpu")
    assert calls[0]["address"] == "local" and calls[0]["num_cpus"] == 1
    assert "127.0.0.1:1) does not answer" in caplog.text
    # negative control: RAY_ADDRESS pointing at the same dead address is an error, not a silent local start
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(cluster.ClusterUnreachableError):
        cluster.connect({"num_cpus": 1}, "cpu")
    assert len(calls) == 1


def test_verl_runtime_env_reaches_ray_init(monkeypatch):
    """verl 0.9's ``ray_kwargs.ray_init.runtime_env`` (its scripts set ``py_executable``; null means this interpreter)
    from a loaded config to ``ray.init``. Ray itself is replaced, as above; the rank group's own conversion is used."""
    from omegaconf import OmegaConf

    from posttrain.config import load_config

    ray = pytest.importorskip("ray")
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(cluster, "start_reaper", lambda: None)
    monkeypatch.setattr(cluster, "start_run_peak", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "_recorded_address", lambda temp_dir: None)
    for extra, expected in ((["ray_kwargs.ray_init.runtime_env.py_executable=null"], None),
                            (["ray_kwargs.ray_init.runtime_env.py_executable=/opt/venv/bin/python3",
                              "+ray_kwargs.ray_init.runtime_env.env_vars.MY_FLAG=1"], "/opt/venv/bin/python3")):
        config = load_config(validate=False, overrides=extra)
        cluster.connect(OmegaConf.to_container(OmegaConf.structured(config.ray_kwargs.ray_init), resolve=True), "cpu")
        env = calls[-1]["runtime_env"]
        assert env.get("py_executable") == expected  # null is left out: Ray's default, this interpreter
    assert env["env_vars"]["MY_FLAG"] == 1 and env["env_vars"]["TOKENIZERS_PARALLELISM"] == "false"
