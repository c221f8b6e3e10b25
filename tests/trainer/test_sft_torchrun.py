"""verl's launch, `torchrun --nproc_per_node=2 -m posttrain.trainer.fsdp_sft_trainer ...`, with gloo on
CPU: the two processes train as one process does (same losses, same validation loss), rank 0 seals
the checkpoint both ranks wrote, and the export loads."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.sft import tiny_sft_overrides

ROOT = Path(__file__).resolve().parents[2]
EXTRA = ["trainer.total_training_steps=3", "trainer.save_freq=3", "trainer.test_freq=3"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # two torchrun ranks and a one-process run (~16 s on 2 Zen 3 cores): `python -m pytest -m slow`
def test_torchrun_two_cpu_ranks_equal_one_process(tmp_path):
    from posttrain.config.sft_load import load_sft_config
    from posttrain.trainer.sft_trainer import SFTTrainer

    SFTTrainer(load_sft_config(overrides=tiny_sft_overrides(tmp_path / "one", EXTRA))).fit()
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "posttrain.trainer.fsdp_sft_trainer", *tiny_sft_overrides(tmp_path / "two", EXTRA)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one, two = metrics(tmp_path / "one" / "run"), metrics(tmp_path / "two" / "run")
    assert [m["step"] for m in two] == [1, 2, 3]  # rank 0 alone logs
    for a, b in zip(one, two):
        for key in ("train/loss", "train/grad_norm"):
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (a["step"], key, a[key], b[key])
    assert math.isclose(one[-1]["val/loss"], two[-1]["val/loss"], rel_tol=1e-4)
    ckpt = tmp_path / "two" / "ckpt"
    assert (ckpt / "global_step_3" / "actor" / "dcp" / ".metadata").exists()  # shards of both ranks
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (ckpt / "hf_model" / "config.json").exists()


@pytest.mark.slow  # three torchrun ranks to the second step (~35 s on 2 busy cores)
def test_a_rank_killed_mid_run_leaves_one_line_on_each_survivor(tmp_path):
    """Issue 59: when one rank was killed, rank 0 printed gloo tracebacks (the collective's, then the shutdown
    barrier's). Each survivor now prints one line naming the lost rank and ends non-zero."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIE_RANK": "1", "DIE_STEP": "2",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    extra = ["trainer.total_training_steps=4", "trainer.save_freq=-1", "trainer.test_freq=-1",
             "data.train_batch_size=6", "data.micro_batch_size_per_gpu=2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           str(ROOT / "tests" / "helpers" / "rank_dies.py"), *tiny_sft_overrides(tmp_path, extra)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    for rank in (0, 2):
        line = (f"error: rank 1 of 3 ended or stopped answering during update_actor (rank {rank} saw its connection "
                f"close); rank {rank} stops too: its own output says why (killed, out of memory, an error)")
        assert proc.stderr.count(line) == 1, proc.stderr[-4000:]
    assert "[rank0]: Traceback" not in proc.stderr and "[rank2]: Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "gloo" not in proc.stderr.split("ChildFailedError")[0], proc.stderr[-4000:]  # torchrun's own report follows
