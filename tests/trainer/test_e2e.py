"""End to end on a tiny random model: each estimator runs a few steps with finite metrics and
verl's metric names; PPO trains a critic; the metrics file is written."""

import json
import math

import pytest

from helpers.tiny_run import tiny_trainer
from posttrain.host.resident import current_resident_bytes

CORE_METRICS = [
    "critic/score/mean", "critic/score/max", "critic/score/min", "critic/rewards/mean",
    "critic/advantages/mean", "critic/advantages/max", "critic/advantages/min",
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
    "response_length/mean", "response_length/max", "response_length/clip_ratio", "prompt_length/mean",
    "timing_s/gen", "timing_s/reward", "timing_s/old_log_prob", "timing_s/adv", "timing_s/update_actor",
    "timing_s/step", "perf/throughput", "training/rollout_actor_probs_diff_mean",
    "memory/peak_resident_gb", "memory/resident_gb/gen", "memory/resident_gb/update_actor", "memory/resident_gb/step",
]


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus"])
def test_estimators_run_three_steps(tmp_path, estimator, capsys):
    trainer = tiny_trainer(tmp_path, [f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.actor.use_kl_loss=True"])
    history = trainer.fit()
    assert [row["step"] for row in history] == [1, 2, 3]
    for row in history:
        missing = [k for k in CORE_METRICS + ["actor/kl_loss", "timing_s/ref"] if k not in row]
        assert missing == []
        assert all(math.isfinite(v) for v in row.values())
    for row in history:  # this process's peak: at least what any phase held, and what it holds now
        assert row["memory/peak_resident_gb"] >= max(v for k, v in row.items() if k.startswith("memory/resident_gb/"))
    assert history[-1]["memory/peak_resident_gb"] * 1e9 >= (current_resident_bytes() or 0) * 0.9
    if estimator == "grpo":  # the run ends with one memory figure, the process tree's peak (issue 59)
        from posttrain.trainer.report import summarize_run

        summarize_run(trainer, history)
        peaks = [l for l in capsys.readouterr().out.splitlines() if "peak" in l and "GB" in l]
        assert len(peaks) == 1 and peaks[0].startswith("peak memory: ") and peaks[0].endswith(" GB (process tree)")
        assert float(peaks[0].split()[2]) >= history[-1]["memory/peak_resident_gb"] - 0.005
    # fp32: the engine's log-probs and the recomputed ones agree to float precision
    assert max(r["training/rollout_actor_probs_diff_max"] for r in history) < 1e-4
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


def test_ppo_with_critic_and_kl_in_reward(tmp_path):
    trainer = tiny_trainer(tmp_path, ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1",
                                      "algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=adaptive",
                                      "trainer.critic_warmup=1"])
    history = trainer.fit()
    first, last = history[0], history[-1]
    assert "actor/pg_loss" not in first and "critic/vf_loss" in first  # warm-up step trains the critic only
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/values/mean",
                "critic/returns/mean", "critic/vf_explained_var", "actor/reward_kl_penalty",
                "actor/reward_kl_penalty_coeff", "actor/pg_loss"):
        assert key in last and math.isfinite(last[key]), key
    # adaptive controller moved beta away from its initial value once KL was non-zero
    assert trainer.kl_ctrl.value != 0.001 or last["actor/reward_kl_penalty"] == 0


def test_remax_runs_with_greedy_baseline(tmp_path):
    history = tiny_trainer(tmp_path, ["algorithm.adv_estimator=remax", "trainer.total_training_steps=1"]).fit()
    assert math.isfinite(history[0]["actor/pg_loss"])


def test_validation_metric_per_data_source(tmp_path):
    trainer = tiny_trainer(tmp_path, ["trainer.val_before_train=True", "trainer.test_freq=1",
                                      "trainer.total_training_steps=1"])
    history = trainer.fit()
    assert history[0]["step"] == 0
    # verl's names: the scorer reports acc, so acc is the core field and the reward goes to val-aux
    assert "val-core/posttrain/arithmetic/acc/mean@1" in history[0]
    assert "val-core/posttrain/arithmetic/acc/mean@1" in history[1]
    strict = history[0]["val-core/posttrain/arithmetic/acc/mean@1"]
    flexible = history[0]["val-aux/posttrain/arithmetic/flexible_acc/mean@1"]
    assert strict == history[0]["val-aux/posttrain/arithmetic/reward/mean@1"] and flexible >= strict


def test_validation_reports_the_scorers_numbers_per_data_source():
    """`val-*/<source>/<name>/mean@n` is the mean of what the scorer returned beside its score, per data
    source (hand-computed), acc the core field as in verl; the manager's error count and text are not among them."""
    import numpy as np
    import torch

    from posttrain.batch import Batch
    from posttrain.trainer.validation import run_validation

    sources = np.array(["a", "b", "a", "a"], dtype=object)
    prompts = Batch.from_single_dict({"input_ids": torch.zeros(4, 2, dtype=torch.long), "data_source": sources})

    def score(out):
        extra = {"acc": np.array([1.0, 0.0, 0.0, 1.0]), "flexible_acc": np.array([1.0, 1.0, 1.0, 0.0]),
                 "reward/errors": np.array([0.0, 0.0, 0.0, 1.0]), "note": np.array(["x"] * 4, dtype=object)}
        return torch.tensor([[1.0], [0.0], [0.0], [1.0]]), extra

    metrics, _ = run_validation([prompts], lambda p: p, score, 1)
    assert metrics == {
        "val-aux/a/reward/mean@1": pytest.approx(2 / 3), "val-aux/b/reward/mean@1": 0.0,
        "val-core/a/acc/mean@1": pytest.approx(2 / 3), "val-core/b/acc/mean@1": 0.0,
        "val-aux/a/flexible_acc/mean@1": pytest.approx(2 / 3), "val-aux/b/flexible_acc/mean@1": 1.0,
        "val-aux/a/acc/pass@1": pytest.approx(2 / 3), "val-aux/b/acc/pass@1": 0.0,
    }


def test_a_zero_kl_coefficient_builds_and_runs_no_reference(tmp_path):
    """use_kl_loss=True with kl_loss_coef=0 weighs the KL term by nothing: no reference model is built or run
    (TRL's beta=0); the negative control, coef 0.001, builds one and logs the KL loss."""
    for coef, has_ref in (("0", False), ("0.001", True)):
        trainer = tiny_trainer(tmp_path / coef, ["actor_rollout_ref.actor.use_kl_loss=True",
                                                 f"actor_rollout_ref.actor.kl_loss_coef={coef}",
                                                 "trainer.total_training_steps=1"])
        history = trainer.fit()
        assert trainer.workers.has_ref == has_ref
        assert ("timing_s/ref" in history[0]) == has_ref and ("actor/kl_loss" in history[0]) == has_ref
