"""The DPO trainer: ln 2 at the first step (policy == reference), the margin grows (and does not with
lr = 0), precomputed reference log-probs equal a reference model's, the LoRA reference, bad pairs."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from posttrain.data.schema import DataError, write_rows
from helpers.sft import tiny_dpo_config


def _local_dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta,
                    loss_type, label_smoothing):
    """TRL's sigmoid loss, written out in float64 (stands in until `posttrain.algorithms.dpo` is merged)."""
    assert loss_type == "sigmoid"
    chosen = policy_chosen_logps.double() - ref_chosen_logps.double()
    rejected = policy_rejected_logps.double() - ref_rejected_logps.double()
    logits = beta * (chosen - rejected)
    losses = -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
    return losses, beta * chosen.detach(), beta * rejected.detach()


@pytest.fixture(autouse=True)
def dpo_loss_module(monkeypatch):
    try:
        import posttrain.algorithms.dpo  # noqa: F401  (the real one, once merged)
    except ImportError:
        monkeypatch.setitem(sys.modules, "posttrain.algorithms.dpo", types.SimpleNamespace(dpo_loss=_local_dpo_loss))


def trainer(tmp_path, extra=(), **kw):
    from posttrain.trainer.dpo_trainer import DPOTrainer

    return DPOTrainer(tiny_dpo_config(tmp_path, list(extra)), **kw)


def test_first_step_sigmoid_loss_is_ln2_and_the_margin_grows(tmp_path):
    t = trainer(tmp_path, ["trainer.total_training_steps=10", "optim.lr=3e-3", "trainer.test_freq=10",
                           "dpo.beta=0.5"])
    history = t.fit()
    first = history[0]
    assert math.isclose(first["loss"], math.log(2), rel_tol=1e-6)  # policy == reference before the first step
    assert abs(first["rewards/chosen"]) < 1e-6 and abs(first["rewards/margins"]) < 1e-6
    assert first["logps/chosen"] < 0 and first["logps/rejected"] < 0
    assert history[-1]["rewards/margins"] > 0.3 and history[-1]["loss"] < 0.6
    assert history[-1]["eval_rewards/margins"] > 0  # held-out pairs of the same task
    assert set(first) >= {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                          "logps/chosen", "logps/rejected", "loss", "grad_norm"}


def test_without_learning_the_margin_stays_zero(tmp_path):
    """Negative control: lr = 0 leaves the policy equal to the reference."""
    history = trainer(tmp_path, ["trainer.total_training_steps=3", "optim.lr=1e-30"]).fit()
    assert all(abs(row["rewards/margins"]) < 1e-5 and math.isclose(row["loss"], math.log(2), rel_tol=1e-5)
               for row in history)


def test_precomputed_reference_equals_the_reference_model(tmp_path):
    runs = [trainer(tmp_path / name, ["trainer.total_training_steps=3", *extra]).fit()
            for name, extra in (("model", []), ("pre", ["dpo.precompute_ref_log_probs=True"]))]
    for a, b in zip(*runs):
        for key in ("loss", "rewards/margins", "logps/chosen", "grad_norm"):
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (key, a[key], b[key])


def test_lora_reference_is_the_policy_with_adapters_disabled(tmp_path):
    pytest.importorskip("peft")
    t = trainer(tmp_path, ["trainer.total_training_steps=4", "model.lora_rank=8", "model.lora_alpha=16",
                           "optim.lr=1e-2"])
    assert t.workers.ref.__class__.__name__ == "LoraReference"  # no second model
    history = t.fit()
    assert math.isclose(history[0]["loss"], math.log(2), rel_tol=1e-6)
    assert history[-1]["rewards/margins"] > history[0]["rewards/margins"]


@pytest.mark.parametrize("row, message", [
    ({"prompt": "p", "chosen": "a", "rejected": "a"}, "are equal"),
    ({"prompt": "p", "chosen": " ", "rejected": "a"}, "column 'chosen' is empty"),
    ({"prompt": "p", "chosen": "a"}, "no column 'rejected'"),
])
def test_bad_pairs_are_one_error_naming_file_row_and_column(tmp_path, row, message):
    from posttrain.config.sft import DPODataConfig
    from posttrain.data.sft import PairDataset
    from helpers.tokenizer import build_tiny_tokenizer

    path = tmp_path / "pairs.jsonl"
    write_rows([{"prompt": "q", "chosen": "x", "rejected": "y"}, row], str(path))
    with pytest.raises(DataError, match=message) as err:
        PairDataset(str(path), build_tiny_tokenizer(), DPODataConfig())
    assert f"{path}: row 1" in str(err.value)


def test_pairs_share_their_prompt_in_adjacent_rows(tmp_path):
    t = trainer(tmp_path, ["trainer.total_training_steps=1"])
    batch = t.train_loader.next_batch()
    assert len(batch) == 16 and torch.equal(batch["prompts"][0::2], batch["prompts"][1::2])
    assert list(batch.non_tensor_batch["uid"][0::2]) == list(batch.non_tensor_batch["uid"][1::2])
    assert (batch["responses"][0::2] != batch["responses"][1::2]).any(-1).all()


def test_the_tutorials_names_import():
    import posttrain
    from posttrain.rollout.hf import HFRolloutEngine
    from posttrain.trainer import DPOTrainer, GRPOTrainer, PPOTrainer
    from posttrain.trainer.dpo_trainer import DPOTrainer as Dpo
    from posttrain.trainer.trainer import RLTrainer
    from posttrain.workers.rollout import HFRollout, vLLMRollout

    assert DPOTrainer is Dpo is posttrain.DPOTrainer and GRPOTrainer is PPOTrainer is RLTrainer
    assert HFRollout is HFRolloutEngine and vLLMRollout.__name__ == "VLLMRolloutEngine"
    from posttrain.workers.rollout import SGLangRollout

    with pytest.raises(NotImplementedError, match="SGLang engine.*Use HFRollout"):
        SGLangRollout(None, None)
