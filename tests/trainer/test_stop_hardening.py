"""Stopping a run at awkward moments (a real `python -m posttrain.trainer.main_ppo` process):

- SIGTERM while a reward function hangs: the run stops at once (not after the reward time-out),
  saves the last finished step, and exits 128 + 15 so that a scheduler sees a pre-empted run;
- SIGINT during start-up (here: while the custom reward file is being imported): it says that
  nothing was trained or saved, and exits 130.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers.tiny_run import tiny_overrides
from posttrain.checkpoint import CheckpointManager, verify_checkpoint

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def _start(overrides):
    return subprocess.Popen([sys.executable, "-m", "posttrain.trainer.main_ppo", *overrides], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)


def _wait_for(path: Path, proc, timeout=180):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _signal_when(marker: Path, overrides, sig) -> tuple[int, str]:
    """Start a run, send ``sig`` once it creates ``marker``; (exit code, its output)."""
    proc = _start(overrides)
    try:
        _wait_for(marker, proc)
        os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, out


def test_sigterm_while_a_reward_hangs_saves_the_last_step_and_exits_143(tmp_path):
    marker = tmp_path / "hanging"
    reward = tmp_path / "reward.py"
    reward.write_text(textwrap.dedent(f"""
        import time
        calls = 0

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            global calls
            calls += 1
            if calls > 8:  # step 1 scores 4 prompts x 2 samples; step 2 hangs
                open({str(marker)!r}, "w").close()
                time.sleep(600)
            return 1.0
    """))
    overrides = tiny_overrides(tmp_path, ["trainer.total_training_steps=5", f"custom_reward_function.path={reward}",
                                          "reward.timeout_s=600"])
    returncode, out = _signal_when(marker, overrides, signal.SIGTERM)
    assert returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "received SIGTERM: stopping the reward computation of step 2 now" in out
    assert "stopped by SIGTERM after step 1; checkpoint saved to" in out
    manager = CheckpointManager(tmp_path / "ckpt")
    assert manager.latest() == manager.step_dir(1) and verify_checkpoint(manager.latest())["step"] == 1


def test_ctrl_c_during_start_up_says_nothing_is_saved(tmp_path):
    marker = tmp_path / "importing"
    reward = tmp_path / "reward.py"
    reward.write_text(f"import time\nopen({str(marker)!r}, 'w').close()\ntime.sleep(600)\n"
                      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    overrides = tiny_overrides(tmp_path, [f"custom_reward_function.path={reward}"])
    returncode, out = _signal_when(marker, overrides, signal.SIGINT)
    assert returncode == 130, out[-3000:]
    assert "received SIGINT during start-up: nothing has been trained yet, so there is nothing to save" in out
    assert "Traceback" not in out
    assert CheckpointManager(tmp_path / "ckpt").step_dirs() == []  # nothing saved (the folder was only claimed)


def test_ctrl_c_during_the_first_validation_says_what_it_does(tmp_path):
    marker = tmp_path / "validating"
    reward = tmp_path / "reward.py"
    reward.write_text(textwrap.dedent(f"""
        import time

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            open({str(marker)!r}, "w").close()
            time.sleep(600)
    """))
    overrides = tiny_overrides(tmp_path, [f"custom_reward_function.path={reward}", "trainer.val_before_train=True",
                                          "reward.timeout_s=600"])
    returncode, out = _signal_when(marker, overrides, signal.SIGINT)
    assert returncode == 130, out[-3000:]
    assert "received SIGINT: stopping the validation before training; nothing is trained yet" in out
    assert "stopped by SIGINT before the first step: nothing was trained, so nothing was saved" in out
    assert CheckpointManager(tmp_path / "ckpt").step_dirs() == []
