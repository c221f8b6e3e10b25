"""The driver-side checks of the Ray worker group that need no cluster."""

from pathlib import Path

from posttrain.distributed.group import unshared_ranks_message
from posttrain.distributed.ray_group import RankInfo


def _rank(r: int, host: str, ip: str) -> RankInfo:
    return RankInfo(rank=r, local_rank=r % 2, local_world_size=2, node_id=host, ip=ip, hostname=host, pid=100 + r, gpu_ids=())


def test_unshared_checkpoint_folder_names_the_ranks_and_hosts():
    ranks = [_rank(0, "head", "10.0.0.1"), _rank(1, "head", "10.0.0.1"), _rank(2, "node2", "10.0.0.2"),
             _rank(3, "node2", "10.0.0.2")]
    message = unshared_ranks_message(ranks, [True, True, False, False], Path("/ckpt"), "trainer.default_local_dir")
    assert message.startswith("trainer.default_local_dir=/ckpt is not shared by all nodes: rank 2 on node2 (10.0.0.2), "
                              "rank 3 on node2 (10.0.0.2) cannot see")
    assert "rank 0" not in message and "filesystem every node mounts" in message
    assert unshared_ranks_message(ranks, [True] * 4, Path("/ckpt"), "trainer.default_local_dir") is None


def test_one_rank_trains_without_ray(tmp_path, monkeypatch):
    """World size 1 never imports Ray: a run trains with `import ray` made impossible."""
    import sys

    from helpers.tiny_run import tiny_trainer

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    history = tiny_trainer(tmp_path, ["trainer.total_training_steps=1"]).fit()
    assert [row["step"] for row in history] == [1]
