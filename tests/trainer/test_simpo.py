"""SimPO (``dpo.loss_type=simpo``, TRL's CPOTrainer names): the loss on a hand-computed pair, one
trainer step equal to a float64 computation from plain forwards (length-averaged log-probs, the margin,
CPO's NLL term over two micro-batches), no reference model loaded, and its keys' errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from helpers.sft import tiny_dpo_config
from posttrain.algorithms.dpo import simpo_loss
from posttrain.errors import ConfigError


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_simpo_loss_on_a_hand_computed_pair():
    # averages -0.5 (chosen) and -1.0 (rejected), beta 2, gamma 0.5: z = 2 x 0.5 - 0.5 = 0.5
    chosen, rejected = torch.tensor([-0.5], dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64)
    losses, chosen_rewards, rejected_rewards = simpo_loss(chosen, rejected, beta=2.0, gamma=0.5)
    assert math.isclose(float(losses), math.log1p(math.exp(-0.5)), rel_tol=1e-12)  # 0.474077...
    assert float(chosen_rewards) == -1.0 and float(rejected_rewards) == -2.0
    smoothed, _, _ = simpo_loss(chosen, rejected, beta=2.0, gamma=0.5, label_smoothing=0.1)
    assert math.isclose(float(smoothed), -0.9 * _log_sigmoid(0.5) - 0.1 * _log_sigmoid(-0.5), rel_tol=1e-12)
    # negative control: without the margin the loss is another number
    no_margin, _, _ = simpo_loss(chosen, rejected, beta=2.0, gamma=0.0)
    assert not math.isclose(float(no_margin), float(losses), rel_tol=1e-3)


def _trainer(tmp_path, extra):
    from posttrain.trainer.dpo_trainer import DPOTrainer

    return DPOTrainer(tiny_dpo_config(tmp_path, ["dpo.loss_type=simpo", *extra]))


def _token_logps(module: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Log-probs of ``response``'s tokens after ``prompt``: one unpadded float64 forward."""
    with torch.no_grad():
        logits = module(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].double()
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def _expected_loss(module, pairs, beta, gamma, alpha) -> float:
    """Mean over pairs of -log sigmoid(beta (avg_c - avg_r) - gamma) + alpha x chosen NLL per chosen token."""
    losses, chosen_nll, chosen_tokens = [], 0.0, 0
    for pair in pairs:
        chosen = _token_logps(module, pair.prompt_ids, pair.chosen_ids)
        rejected = _token_logps(module, pair.prompt_ids, pair.rejected_ids)
        losses.append(-_log_sigmoid(beta * (float(chosen.mean()) - float(rejected.mean())) - gamma))
        chosen_nll, chosen_tokens = chosen_nll - float(chosen.sum()), chosen_tokens + len(pair.chosen_ids)
    return sum(losses) / len(losses) + alpha * chosen_nll / chosen_tokens


def test_one_step_equals_a_float64_computation_and_loads_no_reference(tmp_path):
    beta, gamma, alpha = 2.0, 0.4, 0.5
    t = _trainer(tmp_path, ["data.train_batch_size=4", "data.micro_batch_size_per_gpu=1", f"dpo.beta={beta}",
                            f"dpo.simpo_gamma={gamma}", f"dpo.cpo_alpha={alpha}", "optim.lr=1e-3"])
    assert t.workers.ref is None and not t.workers.has_ref  # reference-free: no second model
    batch = t.train_loader.next_batch()
    policy = copy.deepcopy(t.workers.actor.module).double().eval()  # the weights this step starts from
    first = t.train_step(batch)
    chosen_in_batch = _batch_pairs(t, batch)
    expected = _expected_loss(policy, chosen_in_batch, beta, gamma, alpha)
    assert len(chosen_in_batch) == 4
    assert math.isclose(first["loss"], expected, rel_tol=1e-4), (first["loss"], expected)
    assert first["nll_loss"] > 0 and {"rewards/margins", "logps/chosen", "grad_norm"} <= set(first)
    # negative control: the same pairs without the NLL term are another number
    assert not math.isclose(first["loss"], _expected_loss(policy, chosen_in_batch, beta, gamma, 0.0), rel_tol=1e-3)


def _batch_pairs(t, batch) -> list:
    """The dataset's pairs whose chosen row is in ``batch`` (rows 0, 2, 4, ... are the chosen ones)."""
    rows = {tuple(r[m.bool()].tolist()) for r, m in zip(batch["input_ids"][0::2], batch["attention_mask"][0::2])}
    return [p for p in t.train_data.pairs if tuple(p.prompt_ids + p.chosen_ids) in rows]


def test_simpo_trains_the_margin_up(tmp_path):
    history = _trainer(tmp_path, ["trainer.total_training_steps=8", "optim.lr=3e-3", "dpo.beta=2.0",
                                  "trainer.test_freq=8"]).fit()
    assert history[-1]["rewards/margins"] > history[0]["rewards/margins"] + 0.1
    assert history[-1]["loss"] < history[0]["loss"]
    assert "eval_loss" in history[-1] and "eval_nll_loss" not in history[-1]  # cpo_alpha 0: SimPO itself


@pytest.mark.parametrize("extra, message", [
    (["dpo.loss_type=sigmoid", "dpo.simpo_gamma=1.0"], r"dpo.simpo_gamma=1.0 has no effect with dpo.loss_type='sigmoid'"),
    (["dpo.loss_type=ipo", "dpo.cpo_alpha=1.0"], r"dpo.cpo_alpha=1.0 has no effect with dpo.loss_type='ipo'"),
    (["dpo.cpo_alpha=-1"], r"dpo.cpo_alpha=-1(.0)?: must be >= 0"),
    (["dpo.simpo_gamma=nan"], r"dpo.simpo_gamma=nan: must be a finite number"),
    (["dpo.precompute_ref_log_probs=true"], r"dpo.precompute_ref_log_probs=true with dpo.loss_type=simpo"),
    (["dpo.label_smoothing=0.5"], r"dpo.label_smoothing=0.5: must be in \[0, 0.5\)"),
])
def test_simpo_key_errors_name_the_key(tmp_path, extra, message):
    overrides = extra if extra[0].startswith("dpo.loss_type") else ["dpo.loss_type=simpo", *extra]
    with pytest.raises(ConfigError, match=message):
        tiny_dpo_config(tmp_path, overrides)
