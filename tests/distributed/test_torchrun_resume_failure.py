"""Under torchrun, a resume that fails on one rank only (a refused rng/rank_1.pt) stops every rank at once with
that rank's message, instead of the others training on into the collective time-out (issue 40).

Two gloo ranks in two processes; the rank's worker is a stand-in whose load raises on rank 1 only. The
process group's time-out is short, so a rank left waiting would fail the test instead of passing late."""

import datetime
import os
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from posttrain.checkpoint import CheckpointError
from posttrain.distributed.torchrun import TorchrunGroup


class _Worker:
    def __init__(self, rank: int, fail_on: int | None):
        self.rank, self.fail_on = rank, fail_on

    def load_checkpoint(self, folder: str) -> str:
        if self.rank == self.fail_on:
            raise CheckpointError(f"{folder}/rng/rank_{self.rank}.pt holds code, not a random state; refused")
        return f"rank {self.rank} restored"


def _rank(rank: int, port: int, fail_on, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    group = object.__new__(TorchrunGroup)  # the group without building a model: only its resume step runs
    group.worker, group.rank, group.world_size = _Worker(rank, fail_on), rank, 2
    try:
        said = f"ok: {group.load_checkpoint('/ckpt/global_step_2')}"
    except CheckpointError as err:
        said = f"error: {err}"
    group.shutdown()  # the barrier every rank meets on the way out
    with open(f"{out}/{rank}", "w") as f:
        f.write(said)


def _run(tmp_path, fail_on):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(port, fail_on, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    return [(tmp_path / str(r)).read_text() for r in range(2)]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed")
def test_a_resume_failure_on_one_rank_stops_every_rank_with_its_message(tmp_path):
    said = _run(tmp_path, fail_on=1)
    want = ("error: resuming from /ckpt/global_step_2 failed on rank 1 of 2: /ckpt/global_step_2/rng/rank_1.pt "
            "holds code, not a random state; refused")
    assert said == [want, want]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed")
def test_a_resume_that_succeeds_everywhere_returns_each_ranks_own_result(tmp_path):
    """The negative control: no failure, no error, each rank's own answer."""
    assert _run(tmp_path, fail_on=None) == ["ok: rank 0 restored", "ok: rank 1 restored"]
