"""Two Ray ranks (gloo) sharing ONE `posttrain sandbox serve` through SandboxFusionTool's sandbox_fusion_url:
each rank's code runs and its own results come back, and what bounds concurrency is checked from the
runs' own start/end times (printed by the code, so no timing is asserted, only which runs overlapped):

- the server's ``--num-workers`` bounds the runs at once across every rank;
- the tool's ``rate_limit`` (with ``enable_global_rate_limit``, shared by the tools of one process) and its
  ``num_workers`` bound one rank's calls, not the other rank's: verl's limiter is a Ray actor shared by the
  whole job, posttrain's is per process, so with a shared server the server's --num-workers is the job-wide cap.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from sandbox_checks import TOKEN, serving

ray = pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent
SERVER_WORKERS = 3
SLEEP_S = 1.5  # long next to an interpreter start on a busy machine, so runs let in together do overlap


def call_code(rank: int, call: int) -> str:
    """Sleeps, then prints its start and end (wall clock) and the sum of squares below n(rank, call)."""
    return (f"import time\nstart = time.time()\ntime.sleep({SLEEP_S})\n"
            f"print(start, time.time(), sum(i * i for i in range({n_of(rank, call)})))")


def n_of(rank: int, call: int) -> int:
    return 1000 * (rank + 1) + 7 * call


def squares_below(n: int) -> int:
    return (n - 1) * n * (2 * n - 1) // 6  # the closed form: the independent reference


class SandboxRank:
    """One rank: a gloo process group, the tool built from a verl tool YAML, the calls made at once."""

    def __init__(self, rank: int, world: int, init_method: str):
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        self.rank = rank

    def call_all(self, tool_yaml: str, codes: list[str]) -> list:
        """Every rank's (tool text, metrics) per call, all-gathered over gloo."""
        import asyncio

        import torch.distributed as dist

        from posttrain.tools.utils.tool_registry import initialize_tools_from_config

        (tool,) = initialize_tools_from_config(tool_yaml)

        async def one(code):
            instance, _ = await tool.create()
            response, _, metrics = await tool.execute(instance, {"code": code})
            await tool.release(instance)
            return response.text, metrics

        async def every():
            return await asyncio.gather(*(one(code) for code in codes))

        dist.barrier()  # both ranks call at the same time
        mine = asyncio.run(every())
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return gathered

    def shutdown(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


@pytest.fixture(scope="module")
def server_url():
    with serving("--timeout-s", "20", "--num-workers", str(SERVER_WORKERS)) as url:
        yield url


@pytest.fixture(scope="module")
def ray_cluster():
    # the ranks import this module (SandboxRank) and its helpers by name
    path = os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "POSTTRAIN_SANDBOX_TOKEN": TOKEN}})  # the server's
    yield
    ray.shutdown()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_on_two_ranks(tmp_path, server_url: str, config: str, calls_per_rank: int) -> list:
    """Fresh rank processes (the process-wide limiter is sized by its first tool), one tool YAML."""
    tool_yaml = tmp_path / "tools.yaml"
    tool_yaml.write_text("tools:\n  - class_name: posttrain.tools.sandbox_fusion_tools.SandboxFusionTool\n"
                         f"    config: {{sandbox_fusion_url: {server_url}, default_timeout: 20, {config}}}\n")
    init = f"tcp://127.0.0.1:{free_port()}"
    ranks = [ray.remote(num_cpus=1)(SandboxRank).remote(r, 2, init) for r in range(2)]
    try:
        answers = ray.get([rank.call_all.remote(str(tool_yaml), [call_code(r, c) for c in range(calls_per_rank)])
                           for r, rank in enumerate(ranks)], timeout=180)
        ray.get([rank.shutdown.remote() for rank in ranks])
    finally:
        for rank in ranks:
            ray.kill(rank)
    assert answers[0] == answers[1]  # each rank gathered both ranks' answers: the same lists
    return answers[0]


def intervals_checked(gathered: list) -> list[list[tuple[float, float]]]:
    """Each rank's (start, end) per call, after checking each answer is that call's own result."""
    spans = []
    for rank, answers in enumerate(gathered):
        spans.append([])
        for call, (text, metrics) in enumerate(answers):
            start, end, value = text.split()
            assert int(value) == squares_below(n_of(rank, call)), (rank, call, text)
            assert metrics == {}  # no tool error, no kill
            spans[rank].append((float(start), float(end)))
    return spans


def most_at_once(spans: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda ev: (ev[0], ev[1]))
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


@pytest.mark.slow  # ~40 s: six Ray rank processes and 14 runs of 1.5 s behind a 3-worker server
def test_two_ranks_share_one_server_and_each_limit_bounds_what_it_says(tmp_path, server_url, ray_cluster):
    # room on the ranks: the server's 3 workers bound the 6 calls of both ranks
    spans = intervals_checked(run_on_two_ranks(tmp_path, server_url, "rate_limit: 8, num_workers: 8", 3))
    assert most_at_once(spans[0] + spans[1]) == SERVER_WORKERS
    assert most_at_once(spans[0]) >= 2 and most_at_once(spans[1]) >= 2  # negative control for the next cases

    # rate_limit 1: one call in flight per rank process, while the other rank's call runs beside it
    spans = intervals_checked(run_on_two_ranks(tmp_path, server_url, "rate_limit: 1, num_workers: 8", 2))
    assert most_at_once(spans[0]) == 1 and most_at_once(spans[1]) == 1
    assert most_at_once(spans[0] + spans[1]) == 2

    # num_workers 1: the tool's own worker threads bound one rank's calls the same way
    spans = intervals_checked(run_on_two_ranks(
        tmp_path, server_url, "rate_limit: 8, num_workers: 1, enable_global_rate_limit: false", 2))
    assert most_at_once(spans[0]) == 1 and most_at_once(spans[1]) == 1
    assert most_at_once(spans[0] + spans[1]) == 2
