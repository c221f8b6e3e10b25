"""The driver-side checks of the Ray worker group that need no cluster."""

from pathlib import Path

from posttrain.distributed.rank_group import unshared_ranks_message
from posttrain.distributed.ray_pool import RankInfo


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


def _agreed_dtype_on_rank(rank, world, cache_dir):
    """Rank 0 decides (each rank's own timing could differ); every rank gets rank 0's answer. The
    CPU's capabilities and the timings are injected, and disagree on purpose: rank 0 would measure
    bf16 faster, rank 1 fp32."""
    import os

    import torch

    from helpers.tiny_models import tiny_llama
    from helpers.tokenizer import build_tiny_tokenizer
    from posttrain.distributed.rank import RankPlacement
    from posttrain.models import compute_dtype
    from posttrain.workers.prepare import decide_param_dtype

    os.environ["POSTTRAIN_CACHE_DIR"] = f"{cache_dir}/rank{rank}"  # no shared cache: rank 0 really measures
    compute_dtype.cpu_bf16_support = lambda: (True, "injected")
    timed = []

    def timer(module, device, dtype, **bounds):
        timed.append(dtype)
        return {"bf16": 1.0, "fp32": 2.0}[dtype] if rank == 0 else {"bf16": 2.0, "fp32": 1.0}[dtype]

    compute_dtype.time_train_step = timer
    place = RankPlacement(None, torch.device("cpu"), rank, world)
    choice = decide_param_dtype("auto", tiny_llama(build_tiny_tokenizer()), place.device, place.agree)
    return {"choice": choice, "timed": timed}


def test_ranks_agree_on_rank_zeros_auto_precision(tmp_path):
    from posttrain.distributed.fsdp import run_local_ranks

    results = run_local_ranks(_agreed_dtype_on_rank, 2, str(tmp_path))
    assert [r["choice"] for r in results] == ["bf16", "bf16"]  # rank 1 alone would have said fp32
    assert [r["timed"] for r in results] == [["fp32", "bf16"], []]
