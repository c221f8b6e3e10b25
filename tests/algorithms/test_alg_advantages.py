"""Advantage estimators against float64 loop references, plus properties and registry rules."""

import math

import numpy as np
import pytest
import torch

from posttrain.algorithms import advantages as adv_mod
from posttrain.algorithms import get_adv_estimator_fn, register_adv_est, registered_adv_estimators

TOL = dict(rtol=1e-5, atol=1e-5)
GAMMA, LAM = 0.95, 0.9


def _batch(seed, batch=12, length=6, holes=False, outcome=True):
    """Random batch: right-padded mask (optionally with holes), rewards, values, uids in groups of 1-4."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = torch.arange(length)[None] < lengths[:, None]
    if holes:  # observation tokens inside a response (multi-turn)
        mask &= torch.rand(batch, length, generator=g) > 0.3
        mask[:, 0] = True
    if outcome:  # the reward manager's layout: score on the last valid token
        rewards = torch.zeros(batch, length)
        rewards[torch.arange(batch), lengths - 1] = torch.randn(batch, generator=g)
    else:
        rewards = torch.randn(batch, length, generator=g) * mask
    values = torch.randn(batch, length, generator=g)
    uid = np.array(["a", "a", "a", "b", "b", "c", "d", "d", "d", "d", "e", "e"][:batch], dtype=object)
    return rewards, values, mask.float(), uid


def _groups(uid):
    groups = {}
    for i, u in enumerate(uid):
        groups.setdefault(u, []).append(i)
    return groups


def _std(xs):  # unbiased
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _whiten64(x, mask):
    """Reference whitening over masked entries (unbiased var, 1e-8 inside the sqrt)."""
    vals = [x[i][j] for i in range(len(x)) for j in range(len(x[0])) if mask[i][j]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals) * len(vals) / (len(vals) - 1)
    return [[(e - mean) / math.sqrt(var + 1e-8) for e in row] for row in x]


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def _broadcast(scalars, mask):
    return _t(scalars)[:, None] * mask.double()


def _call(name, rewards, values, mask, uid, **extra):
    """The uniform calling convention the trainer uses."""
    kwargs = dict(
        token_level_rewards=rewards,
        response_mask=mask,
        index=uid,
        values=values,
        reward_baselines=torch.linspace(-1, 1, rewards.shape[0]),
        gamma=GAMMA,
        lam=LAM,
        norm_adv_by_std_in_grpo=True,
        config=None,
        old_log_probs=-torch.rand(rewards.shape, generator=torch.Generator().manual_seed(0)) * 3,
        sum_pi_squared=torch.full(rewards.shape, 0.4),
        rollout_is_weights=None,
    )
    kwargs.update(extra)
    return get_adv_estimator_fn(name)(**kwargs)


# --------------------------------------------------------------------------------- GAE / returns


def _gae_ref(rewards, values, mask):
    r, v, m = rewards.double().tolist(), values.double().tolist(), mask.tolist()
    adv = [[0.0] * len(r[0]) for _ in r]
    for b in range(len(r)):
        next_v, last = 0.0, 0.0
        for t in reversed(range(len(r[0]))):
            if m[b][t]:
                delta = r[b][t] + GAMMA * next_v - v[b][t]
                last = delta + GAMMA * LAM * last
                next_v = v[b][t]
            adv[b][t] = last  # masked tokens carry the later advantage
    returns = [[a + vv for a, vv in zip(ra, rv)] for ra, rv in zip(adv, v)]
    return _t(_whiten64(adv, m)), _t(returns)


@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_loop_reference(holes):
    rewards, values, mask, uid = _batch(1, holes=holes, outcome=False)
    advantages, returns = _call("gae", rewards, values, mask, uid)
    ref_adv, ref_ret = _gae_ref(rewards, values, mask)
    torch.testing.assert_close(advantages.double(), ref_adv, **TOL)
    torch.testing.assert_close(returns.double(), ref_ret, **TOL)


def test_gae_hand_case():
    # one row, 2 tokens, gamma=lam=1 before whitening:
    # t=1: delta = 1 + 0 - 0.5 = 0.5, A1 = 0.5;  t=0: delta = 0 + 0.5 - 0.2 = 0.3, A0 = 0.3 + 0.5 = 0.8
    # returns = A + V = [1.0, 1.0]; whitened A: mean 0.65, var (unbiased) 0.045 -> +-0.15/sqrt(0.045)
    rewards, values, mask = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.2, 0.5]]), torch.ones(1, 2)
    fn = get_adv_estimator_fn("gae")
    advantages, returns = fn(token_level_rewards=rewards, values=values, response_mask=mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0]]))
    s = 0.15 / math.sqrt(0.045 + 1e-8)
    torch.testing.assert_close(advantages, torch.tensor([[s, -s]]), **TOL)


def test_gae_bool_mask_equals_float_mask():
    rewards, values, mask, uid = _batch(2, holes=True, outcome=False)
    a_f, r_f = _call("gae", rewards, values, mask, uid)
    a_b, r_b = _call("gae", rewards, values, mask.bool(), uid)
    assert torch.equal(a_f, a_b) and torch.equal(r_f, r_b)


def _rpp_ref(rewards, mask, gamma):
    r, m = rewards.double().tolist(), mask.tolist()
    ret = [[0.0] * len(r[0]) for _ in r]
    for b in range(len(r)):
        running = 0.0
        for t in reversed(range(len(r[0]))):
            if m[b][t]:  # masked tokens: return 0, running return carried through
                running = r[b][t] + gamma * running
                ret[b][t] = running
    adv = _t(_whiten64(ret, m)) * mask.double()
    return adv, _t(ret)


@pytest.mark.parametrize("holes", [False, True])
def test_reinforce_plus_plus_matches_loop_reference(holes):
    rewards, values, mask, uid = _batch(3, holes=holes, outcome=False)
    config = type("Algo", (), {"gamma": 0.8})()  # verl reads gamma from the config
    advantages, returns = _call("reinforce_plus_plus", rewards, values, mask, uid, config=config)
    ref_adv, ref_ret = _rpp_ref(rewards, mask, 0.8)
    torch.testing.assert_close(advantages.double(), ref_adv, **TOL)
    torch.testing.assert_close(returns.double(), ref_ret, **TOL)
    # without a config the explicit gamma is used
    advantages, returns = _call("reinforce_plus_plus", rewards, values, mask, uid)
    torch.testing.assert_close(returns.double(), _rpp_ref(rewards, mask, GAMMA)[1], **TOL)


def test_remax_matches_reference():
    rewards, values, mask, uid = _batch(4, outcome=False)
    baselines = torch.linspace(-1, 1, rewards.shape[0])
    advantages, returns = _call("remax", rewards, values, mask, uid, reward_baselines=baselines)
    r, m = (rewards * mask).double().tolist(), mask.tolist()
    ref_ret = [[sum(row[t:]) for t in range(len(row))] for row in r]
    ref_adv = [[ref_ret[b][t] - baselines[b].item() * m[b][t] for t in range(len(r[0]))] for b in range(len(r))]
    torch.testing.assert_close(returns.double(), _t(ref_ret), **TOL)
    torch.testing.assert_close(advantages.double(), _t(ref_adv), **TOL)


# --------------------------------------------------------------------------------- group baselines


def _scores(rewards):
    return [sum(row) for row in rewards.double().tolist()]


def _grpo_ref(rewards, uid, norm, eps=1e-6):
    s, out = _scores(rewards), [0.0] * len(uid)
    for rows in _groups(uid).values():
        xs = [s[i] for i in rows]
        mean, std = (sum(xs) / len(xs), _std(xs)) if len(xs) > 1 else (0.0, 1.0)
        for i in rows:
            out[i] = (s[i] - mean) / (std + eps) if norm else s[i] - mean
    return out


def _rloo_ref(rewards, uid):
    s, out = _scores(rewards), [0.0] * len(uid)
    for rows in _groups(uid).values():
        for i in rows:
            others = [s[j] for j in rows if j != i]
            out[i] = s[i] - sum(others) / len(others) if others else s[i]
    return out


def _opo_ref(rewards, mask, uid):
    s, lens, out = _scores(rewards), mask.sum(-1).tolist(), [0.0] * len(uid)
    for rows in _groups(uid).values():
        base = sum(lens[i] * s[i] for i in rows) / sum(lens[i] for i in rows) if len(rows) > 1 else 0.0
        for i in rows:
            out[i] = s[i] - base
    return out


def _gpg_ref(rewards, uid):
    s = _scores(rewards)
    alpha = len(s) / max(sum(1 for x in s if x != 0), 1)
    out = [0.0] * len(uid)
    for rows in _groups(uid).values():
        mean = sum(s[i] for i in rows) / len(rows) if len(rows) > 1 else 0.0
        for i in rows:
            out[i] = alpha * (s[i] - mean)
    return out


def _passk_ref(rewards, uid, norm, eps=1e-6):
    s, out = _scores(rewards), [0.0] * len(uid)
    for rows in _groups(uid).values():
        ordered = sorted(rows, key=lambda i: -s[i])
        gap = s[ordered[0]] - s[ordered[1]]
        out[ordered[0]] = gap / (_std([s[i] for i in rows]) + eps) if norm else gap
    return out


def _rpp_baseline_ref(rewards, mask, uid):
    s, centred = _scores(rewards), [0.0] * len(uid)
    for rows in _groups(uid).values():
        mean = sum(s[i] for i in rows) / len(rows) if len(rows) > 1 else 0.0
        for i in rows:
            centred[i] = s[i] - mean
    tiled = [[c * m for m in row] for c, row in zip(centred, mask.tolist())]
    return _t(_whiten64(tiled, mask.tolist())) * mask.double()


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_loop_reference(norm):
    rewards, values, mask, uid = _batch(5)
    advantages, returns = _call("grpo", rewards, values, mask, uid, norm_adv_by_std_in_grpo=norm)
    ref = _broadcast(_grpo_ref(rewards, uid, norm), mask)
    torch.testing.assert_close(advantages.double(), ref, **TOL)
    assert torch.equal(advantages, returns)


@pytest.mark.parametrize(
    "name, ref_fn",
    [
        ("rloo", lambda r, m, u: _rloo_ref(r, u)),
        ("opo", _opo_ref),
        ("gpg", lambda r, m, u: _gpg_ref(r, u)),
    ],
)
def test_group_estimators_match_loop_reference(name, ref_fn):
    rewards, values, mask, uid = _batch(6)
    rewards[0] = 0.0  # a zero score changes gpg's alpha
    advantages, returns = _call(name, rewards, values, mask, uid)
    torch.testing.assert_close(advantages.double(), _broadcast(ref_fn(rewards, mask, uid), mask), **TOL)
    assert torch.equal(advantages, returns)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_matches_reference(norm):
    rewards, values, mask, uid = _batch(7, batch=10)
    uid = np.array(["a", "a", "a", "b", "b", "d", "d", "d", "d", "b"], dtype=object)  # no group of one
    config = {"norm_adv_by_std_in_grpo": norm}  # verl reads the flag from the config
    advantages, _ = _call("grpo_passk", rewards, values, mask, uid, config=config, norm_adv_by_std_in_grpo=not norm)
    torch.testing.assert_close(advantages.double(), _broadcast(_passk_ref(rewards, uid, norm), mask), **TOL)
    assert (advantages.abs().sum(-1) > 0).sum() == 3  # one non-zero row per group


def test_grpo_passk_rejects_group_of_one():
    rewards, values, mask, uid = _batch(7)
    with pytest.raises(ValueError, match="at least 2"):
        _call("grpo_passk", rewards, values, mask, uid)


def test_reinforce_plus_plus_baseline_matches_reference():
    rewards, values, mask, uid = _batch(8)
    advantages, returns = _call("reinforce_plus_plus_baseline", rewards, values, mask, uid)
    torch.testing.assert_close(advantages.double(), _rpp_baseline_ref(rewards, mask, uid), **TOL)
    assert torch.equal(advantages, returns)


# --------------------------------------------------------------------------------- vectorized forms, GDPO


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_vectorized_matches_loop_reference(norm):
    rewards, values, mask, uid = _batch(20)
    advantages, returns = _call("grpo_vectorized", rewards, values, mask, uid, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(advantages.double(), _broadcast(_grpo_ref(rewards, uid, norm), mask), **TOL)
    assert torch.equal(advantages, returns)
    # negative control: the comparison sees a different normalisation
    assert not torch.allclose(advantages.double(), _broadcast(_grpo_ref(rewards, uid, not norm), mask), **TOL)


def test_rloo_vectorized_matches_loop_reference_and_zeroes_groups_of_one():
    rewards, values, mask, uid = _batch(21)
    advantages, returns = _call("rloo_vectorized", rewards, values, mask, uid)
    single = [rows[0] for rows in _groups(uid).values() if len(rows) == 1]  # "c": row 5
    ref = _rloo_ref(rewards, uid)
    ref = [0.0 if i in single else a for i, a in enumerate(ref)]  # verl's vectorized form: group of one -> 0
    torch.testing.assert_close(advantages.double(), _broadcast(ref, mask), **TOL)
    assert torch.equal(advantages, returns)
    loop, _ = _call("rloo", rewards, values, mask, uid)  # negative control: the loop form keeps A = r there
    assert single and not torch.allclose(loop[single], advantages[single])


def _gdpo_ref(parts, weights, mask, uid, norm):
    """Float64: GRPO of each part within its group, weighted sum, whitened over the mask."""
    combined = [0.0] * len(uid)
    for key, weight in zip(parts, weights):
        per_part = _grpo_ref(torch.tensor(parts[key], dtype=torch.float64)[:, None], uid, norm)
        combined = [c + weight * a for c, a in zip(combined, per_part)]
    tiled = [[c * m for m in row] for c, row in zip(combined, mask.tolist())]
    return _t(_whiten64(tiled, mask.tolist())) * mask.double()


def _gdpo_config(keys, weights=None):
    return {"gdpo_reward_keys": keys, "gdpo_reward_weights": weights}


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("weights", [None, [2.0, 0.5, 1.0]])
def test_gdpo_matches_loop_reference(norm, weights):
    rewards, values, mask, uid = _batch(22)
    g = torch.Generator().manual_seed(22)
    parts = {"accuracy": (torch.rand(12, generator=g) > 0.5).double().numpy(),  # 0/1 and two scales
             "format": (torch.randn(12, generator=g) * 0.1).numpy(),
             "length": (torch.randn(12, generator=g) * 5).numpy()}
    advantages, returns = _call("gdpo", rewards, values, mask, uid, norm_adv_by_std_in_grpo=norm,
                                config=_gdpo_config(list(parts), weights), non_tensor_batch={**parts, "uid": uid})
    ref = _gdpo_ref(parts, weights or [1.0] * 3, mask, uid, norm)
    torch.testing.assert_close(advantages.double(), ref, **TOL)
    assert torch.equal(advantages, returns)
    # negative control: normalising the summed reward instead (GRPO of the sum, whitened) is another number;
    # without the std division both only centre within the group, which is linear: then they agree
    summed = {"sum": sum(w * parts[k] for k, w in zip(parts, weights or [1.0] * 3))}
    assert torch.allclose(advantages.double(), _gdpo_ref(summed, [1.0], mask, uid, norm), **TOL) == (not norm)


def test_gdpo_hand_case_keeps_a_part_the_sum_would_cancel():
    # one group of two one-token responses: accuracy (1, 0), format (0, 1), weights (2, 1)
    # GRPO per part: mean 0.5, std sqrt(0.5) -> accuracy (+0.70711, -0.70711), format (-0.70711, +0.70711)
    # weighted sum: 2 * 0.70711 - 0.70711 = +0.70711 and -0.70711; whitened: mean 0, unbiased var 1 -> same
    # (GRPO of the summed reward 2 * acc + fmt = (2, 1) would give +-0.70711 too, but with equal weights
    # the sum (1, 1) is 0 for both, where GDPO still separates them: second call)
    mask, uid = torch.ones(2, 1), np.array(["g", "g"], dtype=object)
    parts = {"accuracy": np.array([1.0, 0.0]), "format": np.array([0.0, 1.0])}
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # 0.70711
    adv, _ = _call("gdpo", torch.zeros(2, 1), None, mask, uid, config=_gdpo_config(["accuracy", "format"], [2.0, 1.0]),
                   non_tensor_batch=parts)
    w = math.sqrt(2 * a * a + 1e-8)  # the whitening's std of (+a, -a)
    torch.testing.assert_close(adv, torch.tensor([[a / w], [-a / w]]), **TOL)
    adv, _ = _call("gdpo", torch.zeros(2, 1), None, mask, uid, config=_gdpo_config(["accuracy", "format"]),
                   non_tensor_batch=parts)
    torch.testing.assert_close(adv, torch.zeros(2, 1))  # equal weights: the parts cancel within each response


def test_gdpo_without_a_config_is_grpo_whitened_and_refuses_bad_parts():
    rewards, values, mask, uid = _batch(23)
    advantages, _ = _call("gdpo", rewards, values, mask, uid)  # verl's fallback: the score is the one part
    ref = _gdpo_ref({"score": np.array(_scores(rewards))}, [1.0], mask, uid, True)
    torch.testing.assert_close(advantages.double(), ref, **TOL)
    parts = {"acc": np.ones(12), "fmt": np.where(np.arange(12) == 4, np.nan, 1.0)}
    with pytest.raises(ValueError, match="gdpo reward key 'missing' .*must return a dict with 'missing'"):
        _call("gdpo", rewards, values, mask, uid, config=_gdpo_config(["acc", "missing"]), non_tensor_batch=parts)
    with pytest.raises(ValueError, match="'fmt' is missing or not finite in 1 row.*row 4"):
        _call("gdpo", rewards, values, mask, uid, config=_gdpo_config(["acc", "fmt"]), non_tensor_batch=parts)
    with pytest.raises(ValueError, match="2 weights for 1 gdpo_reward_keys"):
        _call("gdpo", rewards, values, mask, uid, config=_gdpo_config(["acc"], [1.0, 2.0]), non_tensor_batch=parts)
    with pytest.raises(ValueError, match="gdpo needs algorithm.gdpo_reward_keys"):
        _call("gdpo", rewards, values, mask, uid, config=_gdpo_config(None), non_tensor_batch=parts)


# --------------------------------------------------------------------------------- properties

OUTCOME = ["grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "opo", "gpg", "reinforce_plus_plus_baseline", "remax",
           "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline"]


def test_grpo_zero_mean_unit_std_per_group():
    rewards, values, mask, uid = _batch(9)
    for norm in (True, False):
        advantages, _ = _call("grpo", rewards, values, mask, uid, norm_adv_by_std_in_grpo=norm)
        per_row = advantages.sum(-1) / mask.sum(-1)
        for rows in _groups(uid).values():
            if len(rows) > 1:
                group = per_row[rows].double()
                assert abs(group.mean().item()) < 1e-5
                if norm:
                    assert group.std().item() == pytest.approx(1.0, abs=1e-4)


def test_group_of_one_and_all_equal_rewards():
    # 0/1 rewards are exact in float32, so an all-equal group gives exactly 0
    rewards = torch.zeros(5, 3)
    rewards[:, -1] = torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0])
    mask, uid = torch.ones(5, 3), np.array(["eq", "eq", "eq", "x", "solo"], dtype=object)
    uid[3] = "eq2"
    grpo, _ = _call("grpo", rewards, None, mask, uid)
    # group "eq": std 0 -> (1 - 1) / (0 + eps) = 0; groups of one: mean 0, std 1 -> r / (1 + 1e-6)
    torch.testing.assert_close(grpo[:, 0], torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0 / (1 + 1e-6)]))
    rloo, _ = _call("rloo", rewards, None, mask, uid)
    torch.testing.assert_close(rloo[:, 0], torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0]))  # group of one: A = r
    opo, _ = _call("opo", rewards, None, mask, uid)
    torch.testing.assert_close(opo[:, 0], torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0]))


def test_gpg_scale_with_a_single_nonzero_score():
    # alpha = batch / max(#non-zero, 1) = 4 / 1; group means 0.5 and 0 -> alpha * (r - mean)
    rewards = torch.tensor([[1.0], [0.0], [0.0], [0.0]])
    gpg, _ = _call("gpg", rewards, None, torch.ones(4, 1), np.array(["a", "a", "b", "b"], dtype=object))
    torch.testing.assert_close(gpg, torch.tensor([[2.0], [-2.0], [0.0], [0.0]]))


def test_length_one_responses():
    rewards = torch.tensor([[1.0], [0.0], [3.0], [5.0]])
    mask, uid = torch.ones(4, 1), np.array(["a", "a", "b", "b"], dtype=object)
    grpo, _ = _call("grpo", rewards, None, mask, uid)
    # group a: mean 0.5, std sqrt(0.5); group b: mean 4, std sqrt(2)
    sa, sb = math.sqrt(0.5) + 1e-6, math.sqrt(2) + 1e-6
    expected = torch.tensor([[0.5 / sa], [-0.5 / sa], [-1 / sb], [1 / sb]])
    torch.testing.assert_close(grpo, expected, **TOL)
    values = torch.tensor([[0.5], [0.1], [1.0], [2.0]])
    _, returns = _call("gae", rewards, values, mask, uid)
    torch.testing.assert_close(returns, rewards)  # A = r - V, returns = A + V = r


def test_outcome_advantages_are_zero_on_masked_tokens():
    rewards, values, mask, uid = _batch(10)
    for name in OUTCOME:
        advantages, _ = _call(name, rewards, values, mask, uid)
        assert torch.all(advantages[mask == 0] == 0), name


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus"])
def test_masked_inputs_never_change_valid_outputs(name):
    rewards, values, mask, uid = _batch(11, holes=True, outcome=False)
    noise = torch.randn(rewards.shape) * (1 - mask) * 100
    base = _call(name, rewards, values, mask, uid)
    moved = _call(name, rewards + noise, values + noise, mask, uid)
    valid = mask.bool()
    for a, b in zip(base, moved):
        assert torch.equal(a[valid], b[valid])


def test_outcome_score_is_the_whole_row_sum_as_in_verl():
    # verl sums token_level_rewards over the full row (the reward manager leaves padding at 0)
    rewards, values, mask, uid = _batch(12)
    shifted = rewards.clone()
    shifted[mask == 0] += 1.0
    a, _ = _call("rloo", rewards, values, mask, uid)
    b, _ = _call("rloo", shifted, values, mask, uid)
    assert not torch.equal(a, b)


def test_every_estimator_accepts_the_uniform_call():
    rewards, values, mask, uid = _batch(13)
    uid = np.array(["a", "a", "b", "b"] * 3, dtype=object)
    algo = {"gamma": GAMMA, "lam": LAM, "norm_adv_by_std_in_grpo": True}
    for name in registered_adv_estimators():
        advantages, returns = _call(name, rewards, values, mask, uid, config=algo)
        assert advantages.shape == returns.shape == rewards.shape, name
        assert torch.isfinite(advantages).all(), name


# --------------------------------------------------------------------------------- registry


def _private_registry(monkeypatch):
    """This test's registrations go into copies of the registry and its declarations."""
    for name in ("ADV_ESTIMATOR_REGISTRY", "_DECLARED"):
        monkeypatch.setattr(adv_mod, name, dict(getattr(adv_mod, name)))


def test_registry_rules(monkeypatch):
    _private_registry(monkeypatch)

    def mine(**kwargs):
        return None, None

    register_adv_est("my_est")(mine)
    register_adv_est("my_est")(mine)  # same function again: allowed
    assert get_adv_estimator_fn("my_est") is mine
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("my_est")(lambda **kwargs: None)
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'.*'gae'.*'grpo'"):
        get_adv_estimator_fn("nope")
    expected = {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg"}
    assert expected | {"grpo_passk"} <= set(registered_adv_estimators())


def test_a_registered_estimator_declares_its_needs_once(monkeypatch):
    """Whether an estimator needs a critic, groups or a greedy baseline is declared with its
    registration; validation, the critic rule, the trainer and `posttrain diff` all read it."""
    from posttrain.config import ConfigError, load_config, uses_critic
    from posttrain.config.validate import GROUP_ESTIMATORS, find_problems
    from posttrain.diff import _estimator_consequence
    from posttrain.trainer.trainer import GREEDY_BASELINE_ESTIMATORS

    _private_registry(monkeypatch)

    @register_adv_est("my_grouped", needs_groups=True, needs_greedy_baseline=True, summary="my grouped baseline")
    def my_grouped(**kwargs):
        return None, None

    @register_adv_est("my_valued", needs_critic=True)
    def my_valued(**kwargs):
        return None, None

    builtin = "posttrain/config/builtin.yaml"
    with pytest.raises(ConfigError, match="algorithm.adv_estimator=my_grouped compares responses to the same prompt"):
        load_config(base=builtin, overrides=["algorithm.adv_estimator=my_grouped", "actor_rollout_ref.rollout.n=1"])
    grouped = load_config(base=builtin, overrides=["algorithm.adv_estimator=my_grouped"])
    assert "my_grouped" in GROUP_ESTIMATORS and "my_grouped" in GREEDY_BASELINE_ESTIMATORS
    assert "grpo" in GROUP_ESTIMATORS and "remax" in GREEDY_BASELINE_ESTIMATORS and "grpo" not in GREEDY_BASELINE_ESTIMATORS
    assert not uses_critic(grouped)
    valued = load_config(base=builtin, overrides=["algorithm.adv_estimator=my_valued", "critic.model.path=m",
                                                  "critic.ppo_micro_batch_size_per_gpu=4"], validate=False)
    assert uses_critic(valued)
    errors, _ = find_problems(load_config(base=builtin, overrides=["algorithm.adv_estimator=my_valued",
                                                                   "critic.enable=False"], validate=False))
    assert any("my_valued needs a learned critic, but critic.enable=False" in e for e in errors)
    assert "my grouped baseline" in _estimator_consequence(grouped, valued)[0]
