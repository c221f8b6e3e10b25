"""Every number of every command's config (train, sft, dpo) is refused at load time when it is NaN, inf
or outside its declared range, with one line naming the key and the valid range (issue 40: checks
written as ``value < low`` let NaN and inf through)."""

import math

import pytest

from posttrain.config.load import load_config
from posttrain.config.ranges import SFT_RANGES, RL_RANGES, Range, numeric_keys, range_of
from posttrain.config.schema import PostTrainConfig
from posttrain.config.sft import DPOConfig, SFTConfig
from posttrain.config.sft_load import load_dpo_config, load_sft_config, sft_problems
from posttrain.config.validate import ASYNC_KEYS, find_problems
from posttrain.errors import ConfigError

DPO_DATA = ["data.train_files=pairs.parquet"]


def _problems(check, load, overrides):
    """Every problem the checks find, or the one a loader refuses while building the tree."""
    try:
        return check(load(overrides=overrides, validate=False))
    except ConfigError as err:
        return [str(err)]


def _rl_errors(overrides):
    return _problems(lambda config: find_problems(config)[0], load_config, overrides)


def _sft_errors(overrides):
    return _problems(sft_problems, load_sft_config, overrides)


def _dpo_errors(overrides):
    return _problems(sft_problems, load_dpo_config, DPO_DATA + overrides)


TREES = [(PostTrainConfig, _rl_errors, RL_RANGES), (SFTConfig, _sft_errors, SFT_RANGES),
         (DPOConfig, _dpo_errors, SFT_RANGES)]


def _float_keys(root):
    return [(key, is_list) for key, default, is_list in numeric_keys(root)
            if isinstance(default, float) or (is_list and default and isinstance(default[0], float))
            or (default is None and "float" in str(_hint(root, key)))]


def _hint(root, key):
    from posttrain.config.docs import leaf_type

    return leaf_type(key, root)


def _naming(errors, key):
    return [e for e in errors if key in e]


@pytest.mark.parametrize("root,errors_of,_", TREES, ids=["train", "sft", "dpo"])
def test_every_float_key_refuses_nan_and_inf(root, errors_of, _):
    keys = _float_keys(root)
    assert len(keys) >= (30 if root is PostTrainConfig else 6)  # the walk found the tree's floats
    defaults = errors_of([])
    for key, is_list in keys:
        assert not _naming(defaults, key), key  # negative control: the default passes
        for bad in ("nan", "inf", "-inf"):
            value = f"[{bad},{bad}]" if is_list else bad
            errors = errors_of([f"{key}={value}"])
            named = _naming(errors, key)
            assert len(named) == 1 and len(errors) == 1, (key, bad, errors)  # one line, naming the key
            if not key.startswith("async_training."):  # checked by its own module, while async is off
                assert named[0].startswith(f"{key}"), named[0]


@pytest.mark.parametrize("root,errors_of,declared", TREES, ids=["train", "sft", "dpo"])
def test_every_int_key_refuses_a_value_below_its_range(root, errors_of, declared):
    checked = 0
    for key, default, is_list in numeric_keys(root):
        allowed = range_of(key, default, declared)
        if is_list or isinstance(default, float) or allowed.low is None or key in ASYNC_KEYS:
            continue  # the async keys' ranges are posttrain.config.async_training's
        below = math.floor(allowed.low) - 1 if not allowed.low_open else math.floor(allowed.low)
        below = below - 1 if below == allowed.off else below
        assert _naming(errors_of([f"{key}={below}"]), key), (key, below)
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("load,overrides,message", [
    (load_sft_config, ["optim.lr=inf"], "optim.lr=inf must be a finite number > 0"),
    (load_sft_config, ["optim.lr=nan"], "optim.lr=nan must be a finite number > 0"),
    (load_sft_config, ["optim.clip_grad=nan"], "optim.clip_grad=nan must be a finite number >= 0"),
    (load_sft_config, ["data.val_max_samples=-5"], "data.val_max_samples=-5 must be >= 1 (or -1: all)"),
    (load_sft_config, ["optim.betas=[0.9,nan]"], "optim.betas=[0.9, nan] must hold finite numbers in [0, 1)"),
    (load_dpo_config, DPO_DATA + ["dpo.beta=inf"], "dpo.beta=inf must be a finite number > 0"),
])
def test_the_issue_cases_fail_at_load_with_one_line(load, overrides, message):
    with pytest.raises(ConfigError) as err:
        load(overrides=overrides)
    assert str(err.value) == message


def test_valid_edges_pass():
    """Negative controls at the edges of declared ranges: -1 where it means 'all', 0 clipping, a
    negative entropy coefficient (a free-sign key)."""
    assert not _sft_errors(["data.val_max_samples=-1", "data.train_max_samples=3", "optim.clip_grad=0"])
    assert not _naming(_rl_errors(["actor_rollout_ref.actor.entropy_coeff=-0.01"]), "entropy_coeff")


def test_range_text_and_holds():
    assert Range(0.0, 1.0, high_open=True).text() == "in [0, 1)"
    assert Range(1.0, off=-1, off_means="all").text() == ">= 1 (or -1: all)"
    r = Range(0.0, low_open=True)
    assert [r.holds(v) for v in (1e-9, 0.0, math.inf, math.nan, -1.0)] == [True, False, False, False, False]
    assert Range(None).holds(-5.0) and not Range(None).holds(-math.inf)


def _timeout_keys():
    from posttrain.config.docs import all_keys

    return sorted(key for key in all_keys() if "timeout" in key.rsplit(".", 1)[-1])


def test_every_timeout_key_means_the_same_by_zero():
    """Issue 59: reward.timeout_s=0 meant "no limit" and multi_turn.tool_timeout_s=0 "time out at once". Every
    time-out is now > 0 seconds (null, where a key allows it, is "no limit"), and its docstring says so."""
    from posttrain.config.docs import all_keys

    keys = _timeout_keys()
    assert {"reward.timeout_s", "actor_rollout_ref.rollout.multi_turn.tool_timeout_s", "actor_rollout_ref.nccl_timeout",
            "actor_rollout_ref.rollout.multi_turn.interaction_timeout_s",
            "actor_rollout_ref.rollout.agent.episode.timeout_s", "trainer.ray_wait_register_center_timeout"} <= set(keys)
    for key in keys:
        expected = "(seconds; null: no limit)" if key == "reward.timeout_s" else "(seconds; 0 would time out at once)"
        zero = 0.0 if "float" in str(_hint(PostTrainConfig, key)) else 0
        assert _rl_errors([f"{key}=0"]) == [f"{key}={zero!r} must be > 0 {expected}"], key
        assert not _naming(_rl_errors([f"{key}=1"]), key)
        assert "> 0" in all_keys()[key].doc, key
    assert not _naming(_rl_errors(["reward.timeout_s=null"]), "reward.timeout_s")
