"""Start-up checks of a multi-turn run: the tool and interaction config files load (classes import,
schemas are valid, each configured class is a tool or an interaction), and every row's ``agent_name``, ``extra_info.tools_kwargs`` and
``extra_info.interaction_kwargs`` name loops, tools and interactions that exist. Each problem is
one ConfigError / DataError naming the file, row and key, before any model loads or any step runs;
the time-outs and guard keys (``max_consecutive_invalid_tool_calls``, ``final_answer_pattern``) are
checked too."""

from __future__ import annotations

import logging
import math
import re
from typing import Any, Iterable, Sequence

from posttrain.errors import ConfigError, DataError

__all__ = ["check_multi_turn_setup", "check_rows", "check_guards", "AGENT_LOOPS"]

logger = logging.getLogger(__name__)

AGENT_LOOPS = ("tool_agent", "single_turn_agent")


def check_multi_turn_setup(config: Any, datasets: Iterable[Any], extra_tool_names: Sequence[str] = (),
                           check_tool_names: bool = True) -> None:
    """Load ``multi_turn``'s files (errors name the file and entry) and check the datasets' rows.
    ``check_tool_names=False`` leaves ``tools_kwargs`` names unchecked (tools may still come from
    the Python API, ``trainer.tools``, which re-runs this check)."""
    from posttrain.interactions.registry import load_interaction_config
    from posttrain.tools.registry import load_tools_config

    mt = config.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return
    check_guards(mt)
    loaded = load_tools_config(mt.tool_config_path) if mt.tool_config_path else []
    _warn_on_slower_tools(loaded, mt.tool_timeout_s)
    tools = [t.name for t in loaded]
    interactions = list(load_interaction_config(mt.interaction_config_path)) if mt.interaction_config_path else []
    names = [*tools, *extra_tool_names] if check_tool_names else None
    for ds in datasets:
        check_rows(ds.rows, ", ".join(ds.files), names, interactions)


def check_guards(mt: Any) -> None:
    """ConfigError when a time-out is not a positive finite number of seconds, the invalid-call cap is
    below 1 or the final-answer pattern is not a regex."""
    key = "actor_rollout_ref.rollout.multi_turn"
    for name in ("tool_timeout_s", "interaction_timeout_s"):
        value = getattr(mt, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ConfigError(f"{key}.{name}={value!r}: expected a positive, finite number of seconds "
                              "(a call past it is abandoned and counted)")
    cap = mt.max_consecutive_invalid_tool_calls
    if cap is not None and cap < 1:
        raise ConfigError(f"{key}.max_consecutive_invalid_tool_calls={cap!r}: expected an integer >= 1, "
                          "or null for no cap")
    if mt.final_answer_pattern:
        try:
            re.compile(mt.final_answer_pattern)
        except re.error as err:
            raise ConfigError(f"{key}.final_answer_pattern={mt.final_answer_pattern!r} is not a regular expression "
                              f"({err})") from None


def _warn_on_slower_tools(tools: Sequence[Any], loop_timeout_s: float) -> None:
    """A tool whose own time-out (``default_timeout``, verl's code interpreter's key) is not below the
    loop's never reports its own: the loop's time-out message replaces it."""
    for tool in tools:
        own = getattr(tool, "default_timeout", None)
        if isinstance(own, (int, float)) and own >= loop_timeout_s:
            logger.warning("tool %s: config.default_timeout=%g s is not below multi_turn.tool_timeout_s=%g s, so a "
                           "run that uses its whole time is cut by the loop first; raise tool_timeout_s above it",
                           tool.name, own, loop_timeout_s)


def check_rows(rows: Sequence[dict], where: str, tool_names: Sequence[str] | None, interactions: Sequence[str]) -> None:
    """DataError naming ``where``, the row and the key of the first row that names an unknown agent
    loop, tool (``tool_names`` None: not checked) or interaction."""
    for i, row in enumerate(rows):
        agent = row.get("agent_name")
        if agent is not None and agent not in AGENT_LOOPS:
            raise DataError(f"{where} row {i}: agent_name={agent!r} is not a loop posttrain has ({', '.join(AGENT_LOOPS)})")
        extra = row.get("extra_info") or {}
        tools_kwargs = extra.get("tools_kwargs") or {}
        if not isinstance(tools_kwargs, dict):
            raise DataError(f"{where} row {i}: extra_info.tools_kwargs must be a mapping tool name -> kwargs")
        unknown = [t for t in tools_kwargs if tool_names is not None and t not in tool_names]
        if unknown:
            raise DataError(f"{where} row {i}: extra_info.tools_kwargs names unknown tool(s) {unknown}; configured tools: "
                            f"{sorted(tool_names) or 'none'} (actor_rollout_ref.rollout.multi_turn.tool_config_path)")
        _check_tool_kwargs(tools_kwargs, f"{where} row {i}: extra_info.tools_kwargs")
        inter = extra.get("interaction_kwargs")
        if inter is not None and not isinstance(inter, dict):
            raise DataError(f"{where} row {i}: extra_info.interaction_kwargs must be a mapping {{name, ...}}, got "
                            f"{type(inter).__name__}")
        if inter:
            name = inter.get("name") if isinstance(inter, dict) else None
            if not interactions or (name is not None and name not in interactions):
                raise DataError(f"{where} row {i}: extra_info.interaction_kwargs.name={name!r} is not configured; "
                                f"interactions: {sorted(interactions) or 'none'} "
                                "(actor_rollout_ref.rollout.multi_turn.interaction_config_path)")


TOOL_KWARGS_KEYS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")


def _check_tool_kwargs(tools_kwargs: dict, where: str) -> None:
    """Each tool's entry is a mapping of TOOL_KWARGS_KEYS to mappings (the loop passes them as keywords)."""
    for tool, entry in tools_kwargs.items():
        if entry is None:
            continue
        if not isinstance(entry, dict):
            raise DataError(f"{where}.{tool} must be a mapping of {', '.join(TOOL_KWARGS_KEYS)}, got {type(entry).__name__}")
        for key, value in entry.items():
            if key not in TOOL_KWARGS_KEYS:
                raise DataError(f"{where}.{tool}.{key}: not a key the loop reads ({', '.join(TOOL_KWARGS_KEYS)})")
            if value is not None and not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
                raise DataError(f"{where}.{tool}.{key} must be a mapping of keyword arguments, got "
                                f"{type(value).__name__}")
