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
