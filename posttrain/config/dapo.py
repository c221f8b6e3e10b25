"""DAPO's keys: dynamic sampling (`algorithm.filter_groups`, `data.gen_batch_size`) and overlong reward
shaping with `reward_model.reward_manager=dapo`, in either of verl's two spellings:

- `reward_model.overlong_buffer.{enable,len,penalty_factor,log}`, measured against
  `data.max_response_length` (verl's DAPO recipe scripts, `recipe/dapo/*.sh`);
- `+reward_model.reward_kwargs.overlong_buffer_cfg.{enable,len,penalty_factor,log}` with
  `+reward_model.reward_kwargs.max_resp_len` (verl's `main_ppo` scripts, which pass reward_kwargs
  to the DAPO reward manager).

The start-up checks' messages name the dotted key, its value and what would be valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from posttrain.config.derived import estimator_needs
from posttrain.config.reward_tree import reward_settings
from posttrain.config.schema import PostTrainConfig

FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
"""`algorithm.filter_groups.metric` values (verl's DAPO trainer): fields of the reward's extra output
(acc, score: a scorer's dict fields, and acc for a plain-number score under reward_manager=dapo), or
the response's summed token-level score (seq_reward) / reward (seq_final_reward)."""


def dapo_problems(config: PostTrainConfig) -> Iterable[str]:
    yield from _filter_groups_problems(config)
    yield from _overlong_problems(config)
    yield from _reward_model_problems(config)


def _filter_groups_problems(config: PostTrainConfig) -> Iterable[str]:
    fg, data = config.algorithm.filter_groups, config.data
    if not fg.enable:
        if data.gen_batch_size != data.train_batch_size and config.actor_rollout_ref.hybrid_engine:  # async: units
            yield (f"data.gen_batch_size={data.gen_batch_size} differs from data.train_batch_size="
                   f"{data.train_batch_size}, but only dynamic sampling draws prompts in generation rounds; set "
                   "algorithm.filter_groups.enable=True or leave data.gen_batch_size at data.train_batch_size")
        return
    if fg.metric not in FILTER_METRICS:
        said = " is not set" if fg.metric is None else f"={fg.metric!r} is not valid"
        yield (f"algorithm.filter_groups.metric{said}; with algorithm.filter_groups.enable=True it must be one of: "
               f"{', '.join(FILTER_METRICS)}")
        return
    if fg.metric == "seq_final_reward" and config.algorithm.use_kl_in_reward:
        yield ("algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=True: groups are "
               "filtered before the reference log-probs that the KL penalty needs exist; use seq_reward (the same "
               "sum before the penalty) or acc")
    # Whether the reward has an acc / score field depends on the scorer (the built-in arithmetic one returns
    # both, gsm8k a plain number, which reward_manager=dapo records as acc): the first step says so if not.


@dataclass(frozen=True)
class OverlongSettings:
    """The overlong buffer as configured, in whichever spelling (see the module docstring)."""

    enable: bool
    length: Any
    penalty_factor: Any
    log: bool
    max_len: Any
    """The response limit the buffer is measured against."""
    prefix: str
    """Where the buffer's keys are, for messages."""
    max_key: str


_KWARGS = "reward_model.reward_kwargs"
_BUFFER_FIELDS = ("enable", "len", "penalty_factor", "log")


def overlong_settings(config: PostTrainConfig) -> OverlongSettings:
    kwargs = config.reward_model.reward_kwargs
    cfg = kwargs.get("overlong_buffer_cfg")
    if not isinstance(cfg, dict):
        buf = config.reward_model.overlong_buffer
        return OverlongSettings(buf.enable, buf.len, buf.penalty_factor, buf.log, config.data.max_response_length,
                                "reward_model.overlong_buffer", "data.max_response_length")
    return OverlongSettings(bool(cfg.get("enable", False)), cfg.get("len", 0), cfg.get("penalty_factor", 0.0),
                            bool(cfg.get("log", False)), kwargs.get("max_resp_len"), f"{_KWARGS}.overlong_buffer_cfg",
                            f"{_KWARGS}.max_resp_len")


def _reward_kwargs_problems(config: PostTrainConfig) -> Iterable[str]:
    kwargs = config.reward_model.reward_kwargs
    for name in sorted(set(kwargs) - {"overlong_buffer_cfg", "max_resp_len"}):
        yield (f"{_KWARGS}.{name}: posttrain's reward manager takes only overlong_buffer_cfg and max_resp_len (the DAPO "
               "manager's keyword arguments)")
    cfg = kwargs.get("overlong_buffer_cfg")
    if cfg is None:
        return
    if not isinstance(cfg, dict):
        yield f"{_KWARGS}.overlong_buffer_cfg={cfg!r} must hold keys: {', '.join(_BUFFER_FIELDS)}"
        return
    for name in sorted(set(cfg) - set(_BUFFER_FIELDS)):
        yield f"{_KWARGS}.overlong_buffer_cfg.{name} is not a key; valid: {', '.join(_BUFFER_FIELDS)}"
    if config.reward_model.overlong_buffer.enable:
        yield (f"the overlong buffer is set twice, in reward_model.overlong_buffer and {_KWARGS}.overlong_buffer_cfg; "
               "keep one")


def _overlong_problems(config: PostTrainConfig) -> Iterable[str]:
    yield from _reward_kwargs_problems(config)
    s = overlong_settings(config)
    if not s.enable:
        return
    if not _is_int(s.max_len) or s.max_len < 1:
        yield f"{s.max_key}={s.max_len!r} must be a number of tokens >= 1 when {s.prefix}.enable=True"
    elif not _is_int(s.length) or not 0 < s.length <= s.max_len:
        yield f"{s.prefix}.len={s.length!r} must be in 1..{s.max_len} ({s.max_key}) when {s.prefix}.enable=True"
    if isinstance(s.penalty_factor, bool) or not isinstance(s.penalty_factor, (int, float)) or not s.penalty_factor >= 0:
        yield f"{s.prefix}.penalty_factor={s.penalty_factor!r} must be >= 0"
    manager = reward_settings(config).manager_name  # reward_model.reward_manager or reward.reward_manager.name
    if manager != "dapo":
        yield (f"{s.prefix}.enable=True with reward_model.reward_manager={manager}: the overlong penalty is "
               "part of the dapo reward manager (as in verl); set reward_model.reward_manager=dapo")


def _reward_model_problems(config: PostTrainConfig) -> Iterable[str]:
    """A learned reward model with combine=replace scores instead of the reward manager (verl returns the
    reward model's scores as they are): neither its fields nor the overlong penalty exist then."""
    rm, fg = config.reward_model, config.algorithm.filter_groups
    if not rm.enable or rm.combine != "replace":
        return
    if fg.enable and fg.metric in ("acc", "score"):
        yield (f"algorithm.filter_groups.metric={fg.metric} with reward_model.enable=True and reward_model.combine=replace: "
               f"the reward model's score replaces the reward function's, which has the {fg.metric} field; use "
               "metric=seq_reward (the reward model's score) or reward_model.combine=sum")
    s = overlong_settings(config)
    if s.enable:
        yield (f"{s.prefix}.enable=True with reward_model.enable=True and reward_model.combine=replace: the reward "
               "model's score replaces the reward manager's, overlong penalty included (as in verl); set "
               "reward_model.combine=sum or turn the buffer off")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def dapo_warnings(config: PostTrainConfig) -> list[str]:
    fg, algo = config.algorithm.filter_groups, config.algorithm
    if not fg.enable:
        return []
    n = config.actor_rollout_ref.rollout.n
    if n == 1:
        return [("algorithm.filter_groups.enable=True with actor_rollout_ref.rollout.n=1: every group holds one "
                 "response, and groups of one are kept (as in verl), so nothing is filtered")]
    if not estimator_needs(algo.adv_estimator, "needs_groups"):
        return [(f"algorithm.filter_groups.enable=True with algorithm.adv_estimator={algo.adv_estimator}, which does "
                 "not compare responses within a group: the groups it drops (all responses scored the same) would "
                 "still have taught it something")]
    return []
