"""verl's launch scripts in examples/, unchanged but for the model (a tiny local one), the data, the
device (2 CPU ranks) and the sizes, run 2 steps through Ray. Slow (a Ray cluster per script):
`python -m pytest -m slow tests/distributed/test_example_scripts.py`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

from helpers.tiny_run import tiny_model_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def shrunk(tmp_path: Path) -> list[str]:
    from posttrain.data.arithmetic import write_arithmetic_parquet

    data = tmp_path / "data"
    write_arithmetic_parquet(str(data), n_train=16, n_test=4, digits=1, ops=("+",), seed=0)
    model = tiny_model_dir(tmp_path)
    return [f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
            f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}",
            "trainer.device=cpu", "trainer.n_gpus_per_node=2", "trainer.total_training_steps=2",
            "data.train_batch_size=4", "data.max_prompt_length=192", "data.max_response_length=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.name=hf",  # vLLM is issue 10
            "trainer.logger=[console,file]", "trainer.test_freq=-1", "trainer.save_freq=2",
            f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.run_dir={tmp_path / 'run'}"]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo_deepseek7b_gsm8k.sh", "ppo_deepseek7b_gsm8k.sh"])
def test_example_script_runs_two_steps_on_two_ranks(script, tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(ROOT / "examples" / script), *shrunk(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "/ 2 ranks" in proc.stdout
    assert "step 2/2" in proc.stdout
    assert (tmp_path / "ckpt" / "global_step_2" / "actor" / "dcp" / ".metadata").exists()
    assert (tmp_path / "ckpt" / "hf_model" / "config.json").exists()
