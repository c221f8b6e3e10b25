"""The DPO trainer: ln 2 at the first step (policy == reference), the margin grows (and does not with
lr = 0), precomputed reference log-probs equal a reference model's, the LoRA reference, bad pairs."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.data.schema import DataError, write_rows
from posttrain.errors import ConfigError
from helpers.sft import tiny_dpo_config


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


USER = {"role": "user", "content": "What is 2 + 2?"}


@pytest.mark.parametrize("row, message", [
    ({"prompt": "p", "chosen": "a", "rejected": "a"}, "columns 'chosen' and 'rejected': chosen equals rejected"),
    ({"prompt": "p", "chosen": " ", "rejected": "a"}, "column 'chosen': empty chosen"),
    ({"prompt": "p", "chosen": "a"}, r"missing column 'rejected' \(rejected_key\)"),
    ({"chosen": [USER, {"role": "assistant", "content": "4"}],  # message form, no prompt column: prompts differ
      "rejected": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]},
     "mismatched prompt"),
    ({"prompt": "p" * 300, "chosen": "a", "rejected": "b"}, "column 'prompt': prompt is 3.. tokens, which leaves no "
                                                            "room for a response within max_length=256"),
])
def test_bad_pairs_are_one_error_naming_file_row_and_column(tmp_path, row, message):
    """The trainer reads pairs through `posttrain.data.preference` (every check, before any model loads)."""
    path = tmp_path / "pairs.jsonl"
    write_rows([{"prompt": "q", "chosen": "x", "rejected": "y"}, row], str(path))
    with pytest.raises(DataError, match=message) as err:
        trainer(tmp_path, [f"data.train_files={path}", "data.val_files=null"])
    assert str(err.value).startswith(f"{path} row 1")


def test_bad_pairs_can_be_skipped_and_counted(tmp_path):
    path = tmp_path / "pairs.jsonl"
    good = [{"prompt": f"q{i}", "chosen": "x", "rejected": "y"} for i in range(8)]
    write_rows(good[:3] + [{"prompt": "p", "chosen": "a", "rejected": "a"}, {"prompt": "p", "chosen": " ",
                                                                             "rejected": "a"}] + good[3:], str(path))
    t = trainer(tmp_path, [f"data.train_files={path}", "data.val_files=null", "data.on_bad_row=skip",
                           "trainer.total_training_steps=1"])
    assert len(t.train_data) == 8 and dict(t.train_data.skipped) == {"chosen == rejected": 1, "empty chosen": 1}
    assert t.train_data.sources[3] == f"{path} row 5"
    t.workers.shutdown()


@pytest.mark.parametrize("override, message", [
    ("dpo.loss_type=dpo", r"dpo.loss_type='dpo' is not a DPO loss; valid: \['hinge', 'ipo', 'robust', 'sigmoid', 'simpo'\]"),
    ("dpo.beta=0", r"dpo.beta=0(.0)?: must be > 0"),
    ("dpo.label_smoothing=0.5", r"dpo.label_smoothing=0.5: must be in \[0, 0.5\)"),
    ("dpo.loss_type=ipo dpo.label_smoothing=0.1", r"dpo.label_smoothing=0.1 has no effect with dpo.loss_type='ipo'"),
    ("data.on_bad_row=drop", r"data.on_bad_row='drop'; valid: error, skip"),
    ("data.prompt_dict_keys=[question]", r"data.prompt_dict_keys=\['question'\]: an SFT key"),
])
def test_dpo_config_errors_name_the_key_at_load_time(override, message):
    from posttrain.config.sft_load import load_dpo_config

    with pytest.raises(ConfigError, match=message) as err:
        load_dpo_config(overrides=override.split())
    assert "\n" not in str(err.value)  # one problem, one line


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
