"""Every module of verl 0.9.1's `verl/trainer/` that a launch script starts, with `verl` replaced by
`posttrain`: each exists, none exits 0 having done nothing, and each runs what verl's does (or names what to
use instead and exits non-zero)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.data.schema import write_rows

ROOT = Path(__file__).resolve().parents[2]

VERL_TRAINER_MODULES = ("main_ppo", "main_ppo_v0", "main_ppo_sync", "sft_trainer", "sft_trainer_ray", "main_eval",
                        "main_generation_server", "fsdp_sft_trainer", "main_generation")
"""verl 0.9.1's wheel: verl/trainer/{main_eval, main_generation_server, main_ppo, main_ppo_v0, sft_trainer,
sft_trainer_ray}.py; main_ppo_sync (examples/remax_trainer), and the older fsdp_sft_trainer and main_generation."""

PPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "trainer.n_gpus_per_node=1",
       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
       "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
       "data.train_batch_size=4", "actor_rollout_ref.actor.use_kl_loss=True"]


@pytest.mark.parametrize("name", VERL_TRAINER_MODULES)
def test_every_verl_trainer_module_has_an_entry(name):
    module = importlib.import_module(f"posttrain.trainer.{name}")
    assert callable(getattr(module, "main", None)), f"posttrain.trainer.{name} has no main()"
    assert 'if __name__ == "__main__"' in Path(module.__file__).read_text()


@pytest.mark.parametrize("name", ["main_ppo", "main_ppo_v0", "main_ppo_sync", "sft_trainer", "sft_trainer_ray",
                                  "fsdp_sft_trainer", "main_eval"])
def test_a_missing_data_file_is_an_error_not_a_success(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main = importlib.import_module(f"posttrain.trainer.{name}").main
    key = "data.path" if name == "main_eval" else "data.train_files"
    rest = [] if name == "main_eval" else PPO if name.startswith("main_ppo") else ["trainer.n_gpus_per_node=1"]
    assert main([f"{key}={tmp_path / 'missing.parquet'}", *rest]) != 0
    assert "missing.parquet" in capsys.readouterr().err


@pytest.mark.parametrize("name, mode, hybrid", [("main_ppo", "sync", True), ("main_ppo_sync", "sync", True),
                                                ("main_ppo_v0", "sync", True)])
def test_ppo_entries_resolve_their_trainer_mode(name, mode, hybrid, capsys):
    main = importlib.import_module(f"posttrain.trainer.{name}").main
    assert main(["--cfg", "job", *PPO]) == 0
    out = capsys.readouterr().out
    assert f"trainer_mode: {mode}" in out and f"hybrid_engine: {str(hybrid).lower()}" in out


def test_generation_modules_name_what_to_use_and_fail():
    for name in ("main_generation_server", "main_generation"):
        proc = subprocess.run([sys.executable, "-m", f"posttrain.trainer.{name}", "data.path=x.parquet"],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and "posttrain eval" in proc.stderr and "posttrain serve" in proc.stderr


def test_main_eval_scores_as_verl_does(tmp_path, capsys):
    """Two GSM8K prompts: 2 of 3 responses right (2/3), then 1 of 1 (1.0); test_score/openai/gsm8k = (2/3 + 1) / 2.
    A wrong ground truth gives another number (the check can fail)."""
    from posttrain.trainer.main_eval import main

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "q"}],
             "responses": ["so #### 12", "#### 12", "#### 13"], "reward_model": {"ground_truth": "12"}},
            {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "q"}],
             "responses": ["#### 7"], "reward_model": {"ground_truth": "7"}}]
    write_rows(rows, str(tmp_path / "gen.parquet"))
    assert main([f"data.path={tmp_path / 'gen.parquet'}"]) == 0
    assert capsys.readouterr().out.strip() == str({"test_score/openai/gsm8k": (2 / 3 + 1) / 2})
    rows[1]["reward_model"]["ground_truth"] = "8"
    write_rows(rows, str(tmp_path / "wrong.parquet"))
    assert main([f"data.path={tmp_path / 'wrong.parquet'}"]) == 0
    assert capsys.readouterr().out.strip() == str({"test_score/openai/gsm8k": (2 / 3 + 0) / 2})
    assert main([f"data.path={tmp_path / 'gen.parquet'}", "data.response_key=outputs"]) != 0
    assert "no column 'outputs'" in capsys.readouterr().err
