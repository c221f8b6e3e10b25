"""Start-up checks of DAPO's keys: dynamic sampling (`algorithm.filter_groups`, `data.gen_batch_size`)
and overlong reward shaping (`reward_model.overlong_buffer` with `reward_model.reward_manager=dapo`).

Each message names the dotted key, its value and what would be valid (`validate.py` collects them).
"""

from __future__ import annotations

from typing import Iterable

from posttrain.config.derived import estimator_needs
from posttrain.config.schema import PostTrainConfig

FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
"""`algorithm.filter_groups.metric` values (verl's DAPO trainer): fields of the reward manager's extra
output (acc, score), or the response's summed token-level score (seq_reward) / reward (seq_final_reward)."""


def dapo_problems(config: PostTrainConfig) -> Iterable[str]:
    yield from _filter_groups_problems(config)
    yield from _overlong_problems(config)


def _filter_groups_problems(config: PostTrainConfig) -> Iterable[str]:
    fg, data = config.algorithm.filter_groups, config.data
    if not fg.enable:
        if data.gen_batch_size != data.train_batch_size:
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
    builtin = not config.custom_reward_function.path
    if builtin and fg.metric == "score":
        yield ("algorithm.filter_groups.metric=score: the built-in scorers return plain numbers, so there is no "
               "'score' field to compare; use acc (with reward_model.reward_manager=dapo) or seq_reward")
    if builtin and fg.metric == "acc" and config.reward_model.reward_manager != "dapo":
        yield ("algorithm.filter_groups.metric=acc needs reward_model.reward_manager=dapo with the built-in scorers "
               "(it records their plain-number score as acc, as verl's DAPO manager does); or use seq_reward")


def _overlong_problems(config: PostTrainConfig) -> Iterable[str]:
    buf, rm = config.reward_model.overlong_buffer, config.reward_model
    if not buf.enable:
        return
    max_len = config.data.max_response_length
    if not 0 < buf.len <= max_len:
        yield (f"reward_model.overlong_buffer.len={buf.len} must be in 1..{max_len} (data.max_response_length) "
               "when reward_model.overlong_buffer.enable=True")
    if rm.reward_manager != "dapo":
        yield (f"reward_model.overlong_buffer.enable=True with reward_model.reward_manager={rm.reward_manager}: the "
               "overlong penalty is part of the dapo reward manager (as in verl); set reward_model.reward_manager=dapo")


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
