"""algorithm.rollout_correction inside the training step (hf engine, tiny model): importance weights
reach the actor update, rejection edits the response mask, bypass mode skips the old-log-prob pass."""

from __future__ import annotations

import math

import torch

from helpers.tiny_run import tiny_trainer


def test_rollout_is_and_rs_run_through_the_step(tmp_path):
    trainer = tiny_trainer(tmp_path, ["trainer.total_training_steps=2", "algorithm.rollout_correction.rollout_is=sequence",
                                      "algorithm.rollout_correction.rollout_rs=token_k1",
                                      "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"])
    history = trainer.fit()
    for row in history:
        for key in ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_eff_sample_size",
                    "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_rs_token_k1_mean",
                    "rollout_corr/kl", "rollout_corr/chi2_seq", "timing_s/old_log_prob"):
            assert key in row and math.isfinite(row[key]), key
        # fp32 hf engine: the engine's and the trainer's log-probs agree, so nothing is rejected
        assert row["rollout_corr/rollout_rs_masked_fraction"] == 0.0
        assert abs(row["rollout_corr/rollout_is_mean"] - 1.0) < 1e-3
    batch = trainer.last_batch
    assert batch["rollout_is_weights"].shape == batch["response_mask"].shape
    assert torch.equal(batch["rollout_is_weights"] == 0, batch["response_mask"] == 0)


def test_bypass_mode_skips_the_old_log_prob_pass(tmp_path):
    trainer = tiny_trainer(tmp_path, ["trainer.total_training_steps=2", "algorithm.rollout_correction.bypass_mode=True"])
    history = trainer.fit()
    for row in history:
        assert "timing_s/old_log_prob" not in row and "actor/pg_loss" in row and math.isfinite(row["actor/pg_loss"])
        assert not any(k.startswith("rollout_corr/") for k in row)
    assert torch.equal(trainer.last_batch["old_log_probs"], trainer.last_batch["rollout_log_probs"])
