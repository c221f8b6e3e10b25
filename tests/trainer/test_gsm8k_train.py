"""Real data: GSM8K prepared from `../shared/data/gsm8k/` by `posttrain prep gsm8k`, then 2 steps of
PPO (GAE, n=1) and GRPO (n=2, KL loss) with the tiny model. Every response is scored by the GSM8K
scorer (a spy wraps `posttrain.rewards.gsm8k.compute_score`), and the logged score is its mean."""

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from posttrain.data.prep import main as prep_main
from posttrain.rewards import gsm8k
from helpers.tiny_run import one_thread, tiny_config
from posttrain.trainer.trainer import RLTrainer

GSM8K_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gsm8k"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def gsm8k_parquet(tmp_path_factory):
    if not (GSM8K_DIR / "train.jsonl").exists():
        pytest.skip(f"{GSM8K_DIR} not found")
    out = tmp_path_factory.mktemp("gsm8k")
    assert prep_main(["gsm8k", "--input", str(GSM8K_DIR), "--output", str(out)]) == 0
    train, test = pd.read_parquet(out / "train.parquet"), pd.read_parquet(out / "test.parquet")
    assert (len(train), len(test)) == (7473, 1319)
    assert set(train["data_source"]) == {"openai/gsm8k"}
    return out


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_train_two_steps_on_gsm8k(tmp_path, gsm8k_parquet, monkeypatch, algo):
    extra = {"ppo": ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1"],
             "grpo": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
                      "actor_rollout_ref.actor.use_kl_loss=True"]}[algo]
    config = tiny_config(tmp_path, extra + [
        f"data.train_files={gsm8k_parquet / 'train.parquet'}", f"data.val_files={gsm8k_parquet / 'test.parquet'}",
        "data.max_prompt_length=240", "data.truncation=left", "data.max_response_length=8",
        "trainer.total_training_steps=2"])
    trainer = RLTrainer(config)
    assert len(trainer.data.train) == 7473 and trainer.data.train.num_truncated > 0

    calls = []
    original = gsm8k.compute_score

    def spy(solution_str, ground_truth, *args, **kwargs):
        score = original(solution_str, ground_truth, *args, **kwargs)
        calls.append((solution_str, ground_truth, score))
        return score

    monkeypatch.setattr(gsm8k, "compute_score", spy)
    seen_sources = []
    reward_fn = trainer.reward_fn

    def recording_reward(batch):
        seen_sources.extend(batch.non_tensor_batch["data_source"].tolist())
        return reward_fn(batch)

    trainer._reward_fn = recording_reward  # keep the configured reward manager, just watch it
    history = trainer.fit()

    assert [row["step"] for row in history] == [1, 2]
    for row in history:
        bad = {k: v for k, v in row.items() if not math.isfinite(v)}
        assert bad == {}
        assert "actor/pg_loss" in row and ("critic/vf_loss" in row) == (algo == "ppo")
    per_step = 4 * (1 if algo == "ppo" else 2)
    assert set(seen_sources) == {"openai/gsm8k"} and len(seen_sources) == 2 * per_step
    assert len(calls) == 2 * per_step  # every response went through the GSM8K scorer
    assert all(gt.replace(",", "").lstrip("-").replace(".", "").isdigit() for _, gt, _ in calls)
    for step, row in enumerate(history):
        scores = [s for _, _, s in calls[step * per_step:(step + 1) * per_step]]
        assert row["critic/score/mean"] == pytest.approx(float(np.mean(scores)), abs=1e-6)
    # the scorer is really GSM8K's: the expected "#### answer" format earns 1, the same text without it 0
    _, gt, _ = calls[0]
    assert original(f"so the answer is\n#### {gt}", gt) == 1.0
    assert original(f"so the answer is {gt}", gt) == 0.0
