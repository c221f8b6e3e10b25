"""Where a step's old log-probs come from, and that skipping the separate pass is exact.

With one epoch of one mini-batch the actor cannot move before its update evaluates it, so the
update's own forward (detached) is the old policy: the trainer skips `compute_log_prob` then. The
run must equal one that computes the pass (the reference), metric for metric and weight for weight.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers.tiny_run import one_thread, tiny_config, tiny_trainer
from posttrain.config import derive_sizes

ON_POLICY = ["actor_rollout_ref.actor.ppo_mini_batch_size=4"]  # the whole batch of 4 prompts: one optimizer step


@pytest.mark.parametrize("extra,expected", [
    (ON_POLICY, "update"),
    ([], "recompute"),                                           # 2 mini-batches: the second needs the old policy
    (ON_POLICY + ["actor_rollout_ref.actor.ppo_epochs=2"], "recompute"),
    (ON_POLICY + ["algorithm.use_kl_in_reward=True"], "recompute"),  # the reward reads them before the update
    (ON_POLICY + ["algorithm.rollout_correction.rollout_is=token"], "recompute"),
    (ON_POLICY + ["algorithm.rollout_correction.bypass_mode=True"], "rollout"),
])
def test_source_of_old_log_probs(tmp_path, extra, expected):
    config = tiny_config(tmp_path, extra)
    assert derive_sizes(config).old_log_probs_from == expected


def _run(tmp_path, force_recompute: bool):
    trainer = tiny_trainer(tmp_path, ON_POLICY + ["trainer.total_training_steps=2",
                                                  "actor_rollout_ref.actor.use_kl_loss=True"])
    assert trainer.sizes.old_log_probs_from == "update"
    calls = []
    original = trainer.workers.compute_log_prob
    trainer.workers.compute_log_prob = lambda batch: calls.append(1) or original(batch)
    if force_recompute:
        trainer.sizes = replace(trainer.sizes, old_log_probs_from="recompute")
    with one_thread():
        history = trainer.fit()
    weights = {k: v.clone() for k, v in trainer.workers.actor.module.state_dict().items()}
    return history, weights, len(calls)


def test_skipping_the_pass_on_policy_equals_computing_it(tmp_path):
    skipped, w_skipped, calls_skipped = _run(tmp_path / "a", force_recompute=False)
    computed, w_computed, calls_computed = _run(tmp_path / "b", force_recompute=True)
    assert (calls_skipped, calls_computed) == (0, 2)
    for a, b in zip(skipped, computed):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm",
                    "critic/score/mean", "actor/entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        # the gap between engine and trainer is still reported, from the update's forward
        assert a["training/rollout_actor_probs_diff_mean"] == pytest.approx(
            b["training/rollout_actor_probs_diff_mean"], rel=1e-3, abs=1e-6)
    for name, tensor in w_skipped.items():
        torch.testing.assert_close(tensor, w_computed[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_update_refuses_to_guess_old_log_probs_off_policy(tmp_path):
    """Two mini-batches: the second needs the policy before the first step, which no forward of the
    update sees; leaving the old log-probs out is an error, never a silent on-policy guess."""
    trainer = tiny_trainer(tmp_path, ["trainer.total_training_steps=1"])
    assert trainer.sizes.old_log_probs_from == "recompute"
    trainer.sizes = replace(trainer.sizes, old_log_probs_from="update")
    with one_thread(), pytest.raises(KeyError, match="old_log_probs"):
        trainer.fit()
