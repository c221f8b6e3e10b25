"""optimal_token_baseline and tir_optimal_token_baseline against a float64 loop reference, hand cases, and
the config rule (calculate_sum_pi_squared)."""

import math

import numpy as np
import pytest
import torch

from posttrain.algorithms import get_adv_estimator_fn

TOL = dict(rtol=1e-5, atol=1e-5)


def _batch(seed, batch=14, length=7, holes=False, empty=False):
    """Random rewards, mask (optionally with holes and empty rows), old log-probs, sum pi^2, IS weights, uids."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    if empty:
        lengths[[2, 9]] = 0
    mask = torch.arange(length)[None] < lengths[:, None]
    if holes:  # tool output inside a multi-turn response
        mask &= torch.rand(batch, length, generator=g) > 0.3
    rewards = torch.randn(batch, length, generator=g) * mask  # token rewards, not only the last
    old = -torch.rand(batch, length, generator=g) * 4
    sum_pi2 = torch.rand(batch, length, generator=g) * 0.9 + 0.05
    weights = torch.rand(batch, length, generator=g) * 2
    uid = np.array(list("aaabbcddddeeff")[:batch], dtype=object)
    return rewards, mask.float(), old, sum_pi2, weights, uid


def _otb_ref(rewards, mask, old, sum_pi2, weights, uid, tail, by_valid_index, eps=1e-8):
    """Float64 loops. Each row's valid tokens are its slots: by column (plain) or by their count (tir).
    B at a slot = sum over the group's rows having that slot of G * W / (sum of W + eps)."""
    r, m, o, s = (x.double().tolist() for x in (rewards, mask, old, sum_pi2))
    w_is = weights.double().tolist() if weights is not None else None
    n, length = len(r), len(r[0])
    valid = [[t for t in range(length) if m[i][t]] for i in range(n)]
    G = [[sum(r[i][j] * m[i][j] for j in range(t, length)) for t in range(length)] for i in range(n)]
    norm2 = [[1 - 2 * math.exp(o[i][j]) + s[i][j] for j in range(length)] for i in range(n)]
    if w_is is not None:
        norm2 = [[v * w_is[i][j] ** 2 for j, v in enumerate(row)] for i, row in enumerate(norm2)]
    W = [[sum(norm2[i][j] for j in valid[i] if j <= t) for t in range(length)] for i in range(n)]
    adv = [[0.0] * length for _ in range(n)]
    groups = {}
    for i, u in enumerate(uid):
        if valid[i] or not by_valid_index:  # tir: empty responses take no part
            groups.setdefault(u, []).append(i)
    for rows in groups.values():
        lengths = sorted(len(valid[i]) for i in rows)
        for i in rows:
            for k, t in enumerate(valid[i]):
                slot = k if by_valid_index else t
                column = (lambda j: valid[j][slot] if slot < len(valid[j]) else None) if by_valid_index else (
                    lambda j: slot if m[j][slot] else None)
                members = [(j, column(j)) for j in rows if column(j) is not None]
                base = 0.0
                if len(rows) > 1:
                    base = sum(G[j][c] * W[j][c] for j, c in members) / (sum(W[j][c] for j, c in members) + eps)
                    longest_alone = lengths[-1] > lengths[-2] and len(valid[i]) == lengths[-1]
                    if tail and longest_alone and slot >= lengths[-2]:
                        base = 0.0
                adv[i][t] = G[i][t] - base
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(G, dtype=torch.float64) * 1.0


def _call(name, rewards, mask, old, sum_pi2, weights, uid, **extra):
    return get_adv_estimator_fn(name)(token_level_rewards=rewards, response_mask=mask, index=uid, old_log_probs=old,
                                      sum_pi_squared=sum_pi2, rollout_is_weights=weights, **extra)


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("holes,empty", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("with_weights", [False, True])
def test_matches_loop_reference(name, holes, empty, tail, with_weights):
    rewards, mask, old, sum_pi2, weights, uid = _batch(1 + holes + 2 * empty, holes=holes, empty=empty)
    weights = weights if with_weights else None
    advantages, returns = _call(name, rewards, mask, old, sum_pi2, weights, uid, handle_zero_tail=tail)
    ref_adv, ref_ret = _otb_ref(rewards, mask, old, sum_pi2, weights, uid, tail, name.startswith("tir"))
    torch.testing.assert_close(advantages.double(), ref_adv * mask.double(), **TOL)
    # returns are the reward-to-go over the whole row (verl's), masked or not
    torch.testing.assert_close(returns.double(), ref_ret, **TOL)
    # negative control: the reference tells the other setting of handle_zero_tail apart
    other, _ = _otb_ref(rewards, mask, old, sum_pi2, weights, uid, not tail, name.startswith("tir"))
    assert not torch.allclose(advantages.double(), other * mask.double(), **TOL)


def test_rollout_weights_enter_squared():
    rewards, mask, old, sum_pi2, weights, uid = _batch(5)
    advantages, _ = _call("optimal_token_baseline", rewards, mask, old, sum_pi2, weights, uid)
    ref, _ = _otb_ref(rewards, mask, old, sum_pi2, weights, uid, True, False)
    torch.testing.assert_close(advantages.double(), ref, **TOL)
    not_squared, _ = _otb_ref(rewards, mask, old, sum_pi2, weights.sqrt(), uid, True, False)  # rho, not rho^2
    assert not torch.allclose(advantages.double(), not_squared, **TOL)


def test_hand_case():
    # one group of two: row 0 has two tokens, reward 1 at the end; row 1 one token, reward 0.
    # pi = 0.5 and sum pi^2 = 0.5 everywhere -> ||s||^2 = 1 - 2 * 0.5 + 0.5 = 0.5 per token
    # W: row 0 (0.5, 1.0), row 1 (0.5); G: row 0 (1, 1), row 1 (0)
    # B column 0: (1 * 0.5 + 0 * 0.5) / (0.5 + 0.5) = 0.5; column 1: row 0 alone: 1 * 1 / 1 = 1
    # A: row 0 (1 - 0.5, 1 - 1) = (0.5, 0); row 1 (0 - 0.5) = -0.5
    # handle_zero_tail: row 0 is alone past row 1's length 1 -> its baseline there is 0 -> A = (0.5, 1)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    old, sum_pi2 = torch.full((2, 2), math.log(0.5)), torch.full((2, 2), 0.5)
    uid = np.array(["g", "g"], dtype=object)
    adv, returns = _call("optimal_token_baseline", rewards, mask, old, sum_pi2, None, uid, handle_zero_tail=False)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0], [-0.5, 0.0]]), **TOL)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    adv, _ = _call("optimal_token_baseline", rewards, mask, old, sum_pi2, None, uid)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 1.0], [-0.5, 0.0]]), **TOL)


def test_hand_case_multi_turn_compares_generated_tokens():
    # row 0 generated columns 0 and 2 (tool output at column 1), reward 1 at column 2; row 1 columns 0, 1, reward 0
    # ||s||^2 = 0.5 per generated token: packed W row 0 (0.5, 1.0), row 1 (0.5, 1.0); packed G (1, 1), (0, 0)
    # tir: B = (0.5, 0.5) at the 1st and 2nd generated token -> A row 0 (0.5, _, 0.5), row 1 (-0.5, -0.5, _)
    # by column instead: column 1 has row 1 alone (B 0), column 2 row 0 alone (B 1) -> row 0 (0.5, _, 0)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    old, sum_pi2 = torch.full((2, 3), math.log(0.5)), torch.full((2, 3), 0.5)
    uid = np.array(["g", "g"], dtype=object)
    adv, _ = _call("tir_optimal_token_baseline", rewards, mask, old, sum_pi2, None, uid)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.5], [-0.5, -0.5, 0.0]]), **TOL)
    adv, _ = _call("optimal_token_baseline", rewards, mask, old, sum_pi2, None, uid)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]]), **TOL)


def test_group_of_one_keeps_its_return():
    rewards, mask, old, sum_pi2, _, _ = _batch(6, batch=3)
    uid = np.array(["x", "y", "z"], dtype=object)
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        adv, returns = _call(name, rewards, mask, old, sum_pi2, None, uid)
        torch.testing.assert_close(adv, returns * mask)


def test_config_needs_calculate_sum_pi_squared_and_the_old_log_prob_pass():
    """One clear error naming both keys; bypass mode (no old-log-prob pass) is refused; the pass runs even
    for an on-policy update (it is where the sum of pi^2 comes from)."""
    from posttrain.config import ConfigError, derive_sizes, load_config

    builtin = "posttrain/config/builtin.yaml"
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        with pytest.raises(ConfigError) as err:
            load_config(base=builtin, overrides=[f"algorithm.adv_estimator={name}"])
        assert str(err.value) == (f"algorithm.adv_estimator={name} needs each token's sum of pi^2 over the "
                                  "vocabulary from the old-log-prob pass; set "
                                  "actor_rollout_ref.actor.calculate_sum_pi_squared=True")
        config = load_config(base=builtin, overrides=[f"algorithm.adv_estimator={name}",
                                                      "actor_rollout_ref.actor.calculate_sum_pi_squared=True"])
        assert derive_sizes(config).old_log_probs_from == "recompute"
    assert derive_sizes(load_config(base=builtin)).old_log_probs_from == "update"  # negative control
    with pytest.raises(ConfigError, match="bypass_mode=True skips; set bypass_mode=False"):
        load_config(base=builtin, overrides=["algorithm.adv_estimator=optimal_token_baseline",
                                             "actor_rollout_ref.actor.calculate_sum_pi_squared=True",
                                             "algorithm.rollout_correction.bypass_mode=True",
                                             "actor_rollout_ref.rollout.calculate_log_probs=True"])
    asynchronous = ["algorithm.adv_estimator=optimal_token_baseline",
                    "actor_rollout_ref.actor.calculate_sum_pi_squared=True", "actor_rollout_ref.hybrid_engine=False",
                    "actor_rollout_ref.rollout.n_gpus_per_node=1"]
    with pytest.raises(ConfigError, match="makes only with async_training.compute_prox_log_prob=True"):
        load_config(base=builtin, overrides=asynchronous)
    load_config(base=builtin, overrides=asynchronous + ["async_training.compute_prox_log_prob=True"])
