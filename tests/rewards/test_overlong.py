"""DAPO's overlong reward shaping (`reward_model.overlong_buffer` with `reward_model.reward_manager=dapo`),
checked by hand at the boundary lengths, through the reward manager (EOS counted, penalty added to
the score on the last token, `acc` recorded before it), off when disabled, and its start-up errors.

verl's DAPORewardManager: penalty = min(-(L - (max_len - len)) / len * penalty_factor, 0), where L
is the response's valid length (its attention mask over the response, the EOS included).
"""

import numpy as np
import pytest
import torch

from helpers.tokenizer import build_tiny_tokenizer
from posttrain.batch import Batch
from posttrain.config import ConfigError, load_config
from posttrain.rewards.manager import OverlongBuffer, RewardManager, overlong_penalty

MAX_LEN, BUF = 20, 8  # the penalty starts after 20 - 8 = 12 tokens


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.mark.parametrize("length, expected", [
    (0, 0.0),
    (MAX_LEN - BUF - 1, 0.0),   # 11: inside the budget
    (MAX_LEN - BUF, 0.0),       # 12: exactly max_len - len is not penalised
    (MAX_LEN - BUF + 1, -1 / 8),  # 13: one token into the buffer costs factor / len
    (16, -4 / 8),
    (MAX_LEN, -1.0),            # 20: a response that fills max_len loses the whole factor
])
def test_penalty_at_boundary_lengths(length, expected):
    got = overlong_penalty(torch.tensor([length]), OverlongBuffer(BUF, 1.0, MAX_LEN))
    assert got.dtype == torch.float64 and got.item() == pytest.approx(expected, abs=1e-12)
    # penalty_factor scales it linearly
    half = overlong_penalty(torch.tensor([length]), OverlongBuffer(BUF, 0.5, MAX_LEN))
    assert half.item() == pytest.approx(expected / 2, abs=1e-12)


def test_buffer_as_long_as_the_limit_penalises_from_the_first_token():
    got = overlong_penalty(torch.tensor([0, 1, 10]), OverlongBuffer(10, 2.0, 10))
    assert got.tolist() == pytest.approx([0.0, -0.2, -2.0])


def test_bad_buffer_lengths_are_refused():
    for length in (0, -1, MAX_LEN + 1):
        with pytest.raises(ValueError, match=f"1..{MAX_LEN}"):
            OverlongBuffer(length, 1.0, MAX_LEN)


def _batch(tok, lengths, width=MAX_LEN):
    """Responses of `lengths` tokens, each ending in EOS (<|im_end|>) inside the mask, as the engines
    produce them; a length of `width` has no EOS (cut at the limit)."""
    n = len(lengths)
    responses = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, length in enumerate(lengths):
        ids = tok("7" * width, add_special_tokens=False)["input_ids"][: length - 1] + [tok.eos_token_id]
        if length == width:
            ids = tok("7" * width, add_special_tokens=False)["input_ids"]
        responses[i, :length] = torch.tensor(ids[:length])
        mask[i, :length] = 1
    return Batch.from_dict({"responses": responses, "response_mask": mask},
                           {"data_source": ["posttrain/arithmetic"] * n, "reward_model": [{"ground_truth": "7"}] * n})


def one(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0


def scored(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "acc": 1.0}


LENGTHS = [11, 12, 13, 16, 20]  # EOS included in each but the last


def test_manager_adds_the_penalty_on_the_last_token(tok):
    batch = _batch(tok, LENGTHS)
    manager = RewardManager(tok, compute_score=one, record_acc=True, overlong=OverlongBuffer(BUF, 1.0, MAX_LEN, log=True))
    scores, extra = manager(batch)
    expected = [1.0, 1.0, 1.0 - 1 / 8, 1.0 - 4 / 8, 0.0]
    assert scores.sum(-1).tolist() == pytest.approx(expected)
    for row, length in enumerate(LENGTHS):  # on the last valid token, which is the EOS where there is one
        assert scores[row, length - 1].item() == pytest.approx(expected[row])
        assert scores[row, :length - 1].abs().sum().item() == 0.0
    assert extra["acc"].tolist() == [1.0] * 5  # before the penalty, as verl's DAPO manager records it
    assert extra["overlong_reward"].tolist() == pytest.approx([0.0, 0.0, -1 / 8, -4 / 8, -1.0])
    assert extra["overlong"].tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]  # exactly max_len - len is not overlong


def test_eos_counts_towards_the_length(tok):
    # 12 characters then EOS = 13 valid tokens: one into the buffer
    batch = _batch(tok, [13])
    assert tok.decode(batch["responses"][0][:13].tolist(), skip_special_tokens=True) == "7" * 12
    manager = RewardManager(tok, compute_score=one, overlong=OverlongBuffer(BUF, 1.0, MAX_LEN))
    assert manager(batch)[0].sum().item() == pytest.approx(1.0 - 1 / 8)


def test_dict_scores_keep_their_fields_and_get_the_penalty(tok):
    manager = RewardManager(tok, compute_score=scored, record_acc=True, overlong=OverlongBuffer(BUF, 1.0, MAX_LEN))
    scores, extra = manager(_batch(tok, [12, 20]))
    assert scores.sum(-1).tolist() == pytest.approx([0.5, -0.5])
    assert extra["acc"].tolist() == [1.0, 1.0] and extra["score"].tolist() == [0.5, 0.5]
    assert "overlong" not in extra  # overlong_buffer.log=False records nothing


def test_off_when_disabled(tok):
    """Negative control: the same long responses without the buffer keep their plain score."""
    scores, extra = RewardManager(tok, compute_score=one)(_batch(tok, LENGTHS))
    assert scores.sum(-1).tolist() == [1.0] * 5
    assert "acc" not in extra and "overlong_reward" not in extra


# ---------------------------------------------------------------------- the config keys
BASE = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "trainer.n_gpus_per_node=1",
        "data.max_response_length=20", "reward_model.reward_manager=dapo"]
ON = ["reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.penalty_factor=1.0"]


@pytest.mark.parametrize("overrides, message", [
    (ON + ["reward_model.overlong_buffer.len=21"],
     "reward_model.overlong_buffer.len=21 must be in 1..20 (data.max_response_length)"),
    (ON + ["reward_model.overlong_buffer.len=0"], "reward_model.overlong_buffer.len=0 must be in 1..20"),
    (ON + ["reward_model.overlong_buffer.len=4", "reward_model.overlong_buffer.penalty_factor=-0.5"],
     "reward_model.overlong_buffer.penalty_factor=-0.5 must be >= 0"),
    (ON + ["reward_model.overlong_buffer.len=4", "reward_model.reward_manager=naive"],
     "reward_model.overlong_buffer.enable=True with reward_model.reward_manager=naive"),
    (["reward_model.reward_manager=prime"], "reward_model.reward_manager='prime' is not one of: naive, dapo"),
    (ON + ["reward_model.overlong_buffer.len=4", "reward_model.enable=True", "reward_model.micro_batch_size_per_gpu=4"],
     "reward_model.overlong_buffer.enable=True with reward_model.enable=True and reward_model.combine=replace"),
])
def test_bad_keys_are_named(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=BASE + overrides)
    assert message in str(err.value)


def test_config_builds_the_manager(tok):
    from posttrain.trainer.setup import build_reward_fn

    config = load_config(overrides=BASE + ON + ["reward_model.overlong_buffer.len=20", "reward_model.overlong_buffer.log=True"])
    manager = build_reward_fn(config, tok)
    assert manager.record_acc and manager.overlong == OverlongBuffer(20, 1.0, 20, True)
    # disabled buffer (its len 0 is then not checked); naive manager: neither acc nor penalty
    assert build_reward_fn(load_config(overrides=BASE), tok).overlong is None
    naive = build_reward_fn(load_config(overrides=BASE + ["reward_model.reward_manager=naive"]), tok)
    assert not naive.record_acc and naive.overlong is None
    assert np.isclose(manager(_batch(tok, [20]))[0].sum().item(), -1.0 + 0.0)  # built-in scorer: no answer -> 0


# ---------------------------------------------------------------------- verl's main_ppo spelling
KW = "+reward_model.reward_kwargs"


def test_reward_kwargs_spelling_builds_the_same_manager(tok):
    """verl's main_ppo scripts pass the buffer as reward_kwargs (with their own max_resp_len)."""
    from posttrain.trainer.setup import build_reward_fn

    config = load_config(overrides=BASE + [f"{KW}.overlong_buffer_cfg.enable=True", f"{KW}.overlong_buffer_cfg.len=8",
                                           f"{KW}.overlong_buffer_cfg.penalty_factor=1.0",
                                           f"{KW}.overlong_buffer_cfg.log=False", f"{KW}.max_resp_len=20"])
    manager = build_reward_fn(config, tok)
    assert manager.overlong == OverlongBuffer(8, 1.0, 20, False)
    scores, _ = manager(_batch(tok, LENGTHS))
    assert scores.sum(-1).tolist() == pytest.approx([0.0, 0.0, -1 / 8, -4 / 8, -1.0])  # arithmetic scorer: 0


@pytest.mark.parametrize("overrides, message", [
    ([f"{KW}.overlong_buffer_cfg.enable=True", f"{KW}.overlong_buffer_cfg.len=8"],
     "reward_model.reward_kwargs.max_resp_len=None must be a number of tokens >= 1"),
    ([f"{KW}.overlong_buffer_cfg.enable=True", f"{KW}.overlong_buffer_cfg.len=30", f"{KW}.max_resp_len=20"],
     "reward_model.reward_kwargs.overlong_buffer_cfg.len=30 must be in 1..20 (reward_model.reward_kwargs.max_resp_len)"),
    ([f"{KW}.overlong_buffer_cfg.enable=True", f"{KW}.overlong_buffer_cfg.len=4", f"{KW}.max_resp_len=20",
      f"{KW}.overlong_buffer_cfg.penalty_factor=-1"],
     "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=-1 must be >= 0"),
    ([f"{KW}.overlong_buffer_cfg.lenght=4"], "reward_model.reward_kwargs.overlong_buffer_cfg.lenght is not a key"),
    ([f"{KW}.num_examine=1"], "reward_model.reward_kwargs.num_examine: posttrain's reward manager takes only"),
    (ON + ["reward_model.overlong_buffer.len=4", f"{KW}.overlong_buffer_cfg.enable=False"],
     "the overlong buffer is set twice"),
])
def test_bad_reward_kwargs_are_named(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=BASE + overrides)
    assert message in str(err.value)
