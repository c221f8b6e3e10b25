"""Rewards that misbehave: a hanging scorer is cut off per row (`reward.timeout_s`) and handled per
`reward.on_error`; a scorer stuck where the alarm cannot reach it has its worker killed; nan/inf
scores are errors naming the row; pool workers never outlive the process that started them."""

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from helpers.tokenizer import build_tiny_tokenizer
from posttrain.rewards import BatchRewardFn, RewardError, RewardManager, load_custom_reward_fn

sys.path.insert(0, str(Path(__file__).parent))
from test_reward_manager import make_batch, write_fn  # noqa: E402

HANG = """
import math, signal, time

def hang(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "4":
        time.sleep(120)
    return 1.0

def deaf(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "4":  # blocks SIGALRM: only the manager's deadline can end it
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        time.sleep(120)
    return 1.0

def nan(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan") if ground_truth == "4" else 1.0

def quits(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "4":
        import sys
        sys.exit(3)
    return 1.0

def ctrl_c(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "4":
        raise KeyboardInterrupt
    return 1.0
"""


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_hanging_row_times_out_per_on_error(tmp_path, tok):
    fn = load_custom_reward_fn(write_fn(tmp_path, HANG), "hang")
    b = make_batch(tok, ["a", "b", "c"], ["1", "4", "2"], sources=["s0", "s1", "s2"])
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"row 1 \(data_source='s1', extra_info.index=1\): timed out after 0.3 s"):
        RewardManager(tok, compute_score=fn, timeout_s=0.3)(b)
    scores, extra = RewardManager(tok, compute_score=fn, timeout_s=0.3, on_error="zero")(b)
    assert time.monotonic() - start < 10
    assert scores.sum(1).tolist() == [1.0, 0.0, 1.0] and extra["reward/errors"].tolist() == [0.0, 1.0, 0.0]


def test_pool_times_out_and_kills_a_deaf_worker(tmp_path, tok):
    path = write_fn(tmp_path, HANG)
    b = make_batch(tok, ["a", "b", "c", "d"], ["1", "4", "2", "3"])
    for name in ("hang", "deaf"):
        manager = RewardManager(tok, compute_score=load_custom_reward_fn(path, name), num_workers=2, timeout_s=0.3,
                                on_error="zero")
        start = time.monotonic()
        scores, extra = manager(b)
        assert time.monotonic() - start < 30, name
        assert extra["reward/errors"].tolist() == [0.0, 1.0, 0.0, 0.0], name
        assert scores.sum(1).tolist() == [1.0, 0.0, 1.0, 1.0], name
        manager.close()


def test_nan_and_inf_rewards_name_the_row(tmp_path, tok):
    fn = load_custom_reward_fn(write_fn(tmp_path, HANG), "nan")
    b = make_batch(tok, ["a", "b", "c"], ["1", "4", "2"], sources=["s0", "s1", "s2"])
    with pytest.raises(RewardError, match=r"row 1 \(data_source='s1', extra_info.index=1\): the reward function "
                                          r"returned nan \(not a finite number\)"):
        RewardManager(tok, compute_score=fn)(b)
    scores, extra = RewardManager(tok, compute_score=fn, on_error="zero")(b)
    assert torch.isfinite(scores).all() and extra["reward/errors"].tolist() == [0.0, 1.0, 0.0]
    batch_fn = BatchRewardFn(lambda batch: torch.tensor([1.0, float("inf"), 0.0]))
    with pytest.raises(RewardError, match=r"non-finite reward on 1 of 3 rows: row 1 \(data_source='s1', "
                                          r"extra_info.index=1\) = inf"):
        batch_fn(b)


def test_a_reward_that_calls_sys_exit_is_a_reward_error_naming_the_row(tmp_path, tok):
    path = write_fn(tmp_path, HANG)
    fn = load_custom_reward_fn(path, "quits")
    b = make_batch(tok, ["a", "b", "c"], ["1", "4", "2"], sources=["s0", "s1", "s2"])
    expected = (rf"reward function quits \(in {re.escape(path)}\) failed on row 1 \(data_source='s1', "
                r"extra_info.index=1\): it called sys.exit\(3\); a reward function must return a score")
    for workers in (0, 2):  # in this process and in the scoring pool
        manager = RewardManager(tok, compute_score=fn, num_workers=workers)
        with pytest.raises(RewardError, match=expected):
            manager(b)
        manager.close()
    scores, extra = RewardManager(tok, compute_score=fn, on_error="zero")(b)
    assert scores.sum(1).tolist() == [1.0, 0.0, 1.0] and extra["reward/errors"].tolist() == [0.0, 1.0, 0.0]
    with pytest.raises(RewardError, match=r"batch reward function leave failed on a batch of 3 rows: it called "
                                          r"sys.exit\(3\)"):
        def leave(batch):
            sys.exit(3)
        BatchRewardFn(leave)(b)
    # Ctrl-C inside a scorer still stops at once (it is not a reward error)
    with pytest.raises(KeyboardInterrupt):
        RewardManager(tok, compute_score=load_custom_reward_fn(path, "ctrl_c"), on_error="zero")(b)


def test_a_run_whose_reward_calls_sys_exit_ends_with_the_reward_error_code(tmp_path, capsys, monkeypatch):
    # before: the run ended silently with exit code 3, the code of non-finite losses
    from helpers.tiny_run import tiny_overrides
    from posttrain.cli import main

    monkeypatch.delenv("POSTTRAIN_DEBUG", raising=False)
    reward = tmp_path / "exits.py"
    reward.write_text("import sys\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    sys.exit(3)\n")
    rc = main(["train", *tiny_overrides(tmp_path, [f"custom_reward_function.path={reward}",
                                                  "trainer.total_training_steps=1"])])
    err = capsys.readouterr().err
    assert rc == RewardError.exit_code == 1, err
    last = err.strip().splitlines()[-1]
    assert re.match(rf"error: step 1: reward function compute_score \(in {re.escape(str(reward))}\) failed on row 0 "
                    r"\(data_source='posttrain/arithmetic', extra_info.index=\d+\): it called sys.exit\(3\)", last), err


CHILD = """
import sys, time
sys.path.insert(0, {tests!r})
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.rewards import RewardManager, load_custom_reward_fn
from test_reward_manager import make_batch
tok = build_tiny_tokenizer()
manager = RewardManager(tok, compute_score=load_custom_reward_fn({path!r}, "hang"), num_workers=1, timeout_s=None)
b = make_batch(tok, ["a", "b"], ["4", "4"])
import threading
threading.Thread(target=manager, args=(b,), daemon=True).start()
time.sleep(8)
print(" ".join(str(p) for p in manager._pool._processes), flush=True)
time.sleep(120)
"""


def test_pool_workers_die_with_the_trainer(tmp_path):
    """A trainer killed with SIGKILL while a worker is stuck in a scorer: the worker goes too."""
    tests = str(Path(__file__).resolve().parents[1])
    script = CHILD.format(tests=tests, path=write_fn(tmp_path, HANG))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            cwd=str(Path(__file__).parent))
    try:
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert pids, "the child started no pool worker"
        assert all(_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (dead, not yet reaped by its parent) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
