"""The user's agent: ``async def episode(client, row) -> float`` from a file, or a program run per episode,
and many episodes run at once, each with a time-out, failures counted by cause.

``actor_rollout_ref.rollout.agent.episode.path`` / ``.name`` name the function; ``.command`` a shell
command instead (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``OPENAI_MODEL`` and ``POSTTRAIN_ROW``, the row
as JSON, in its environment; the last line it prints is its reward). :func:`check_agent_setup` loads the
function before any model loads, so a config that names none is one line.

Each episode runs in a daemon thread of its own, on its own event loop (`posttrain.tools.user_code`), with
an ``openai.AsyncOpenAI`` client made there for its key: an episode that blocks its thread or never returns
is abandoned at ``timeout_s`` and cannot stall the others or the run. An episode fails, and is counted
under one cause, when it

- ``raised``: raised an exception (an API error included: a request the server refused),
- ``timeout``: did not return within ``timeout_s``,
- ``not_a_number``: returned something that is not a finite number (``None``, a string, NaN, a bool),
- ``wrong_model``: raised after a request named a model the server does not serve (HTTP 404
  ``model_not_found``; the request itself is counted in ``agent/refused_requests/model_not_found``),
- ``exit_nonzero``: was a program that exited with a non-zero status.

A failed episode never ends the run: its tokens get no loss (``response_mask`` 0) and its reward is 0.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from posttrain.errors import ConfigError, SignalStop
from posttrain.tools.user_code import UserCodeTimeout, run_user_code

__all__ = ["EpisodeProgram", "Outcome", "FAILURES", "KEY", "load_episode_program", "check_agent_setup",
           "agent_enabled", "run_episodes", "plain"]

KEY = "actor_rollout_ref.rollout.agent.episode"
FAILURES = ("raised", "timeout", "not_a_number", "wrong_model", "exit_nonzero")


@dataclass(frozen=True)
class EpisodeProgram:
    """An episode function (``fn``) or a shell ``command``; ``where`` names it in messages."""

    fn: Callable | None
    command: str | None
    where: str


@dataclass
class Outcome:
    """How one episode ended: its reward, or the cause of its failure (``FAILURES``) and a message."""

    reward: float | None
    failure: str | None = None
    message: str = ""
    seconds: float = 0.0


def agent_enabled(config: Any) -> bool:
    """Whether ``config`` (a whole run's, or its ``actor_rollout_ref.rollout``) names an agent episode."""
    rollout = getattr(getattr(config, "actor_rollout_ref", None), "rollout", config)
    ep = rollout.agent.episode
    return bool(ep.path or ep.command)


def load_episode_program(ep: Any) -> EpisodeProgram:
    """The program ``ep`` (``rollout.agent.episode``) names; ConfigError (one line) when it names none."""
    if ep.path and ep.command:
        raise ConfigError(f"{KEY}: set path (a Python file with the episode function) or command, not both")
    if ep.command:
        if not str(ep.command).strip():
            raise ConfigError(f"{KEY}.command is empty")
        return EpisodeProgram(None, str(ep.command), f"command {ep.command!r}")
    if not ep.path:
        raise ConfigError(f"{KEY}: no episode named; set {KEY}.path=FILE.py (with .name, default 'episode') or "
                          f"{KEY}.command")
    full = os.path.abspath(os.path.expanduser(str(ep.path)))
    if not os.path.isfile(full):
        raise ConfigError(f"{KEY}.path={ep.path!r}: file not found ({full})")
    module = _import_file(full, ep.path)
    fn = getattr(module, str(ep.name or ""), None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if inspect.iscoroutinefunction(v) and not k.startswith("_"))
        raise ConfigError(f"{KEY}.name={ep.name!r} is not defined in {ep.path}; async functions there: {found}")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"{KEY}.name={ep.name!r} in {ep.path} is not an async function; expected "
                          "async def episode(client, row) -> float")
    params = [p for p in inspect.signature(fn).parameters.values() if p.default is p.empty
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) > 2:
        raise ConfigError(f"{KEY}.name={ep.name!r} in {ep.path} requires {len(params)} arguments; expected "
                          "async def episode(client, row) -> float")
    return EpisodeProgram(fn, None, f"{ep.path}:{ep.name}")


def _import_file(full: str, shown: str) -> Any:
    name = "posttrain_agent_episode_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{KEY}.path={shown!r}: not a Python file that can be imported")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException as err:  # SystemExit from a script-style file too
        if isinstance(err, (KeyboardInterrupt, SignalStop)):
            raise
        raise ConfigError(f"{KEY}.path={shown!r}: importing it failed: {type(err).__name__}: {err}") from None
    sys.modules[name] = module
    return module


def check_agent_setup(config: Any) -> None:
    """Before any model loads: the episode program loads, and the keys around it fit (one ConfigError)."""
    rollout = config.actor_rollout_ref.rollout
    ep = rollout.agent.episode
    if not agent_enabled(config):
        return
    if not config.actor_rollout_ref.hybrid_engine:
        raise ConfigError(f"{KEY}: agent episodes run in the colocated trainer (actor_rollout_ref.hybrid_engine=True); "
                          "asynchronous rollouts on separate workers do not run them yet")
    if rollout.multi_turn.enable:
        raise ConfigError(f"{KEY} and actor_rollout_ref.rollout.multi_turn.enable: choose one (the episode is the "
                          "agent loop; its tools are its own)")
    for name, ok in (("timeout_s", isinstance(ep.timeout_s, (int, float)) and 0 < ep.timeout_s < math.inf),
                     ("max_concurrent", isinstance(ep.max_concurrent, int) and ep.max_concurrent >= 1)):
        if isinstance(getattr(ep, name), bool) or not ok:
            raise ConfigError(f"{KEY}.{name}={getattr(ep, name)!r}: expected a positive "
                              f"{'number of seconds' if name == 'timeout_s' else 'integer'}")
    if not config.data.return_raw_chat:
        raise ConfigError(f"{KEY}: set data.return_raw_chat=True (each episode receives its row's chat as "
                          "row['prompt'])")
    load_episode_program(ep)


# ---------------------------------------------------------------------------------------- running


def plain(value: Any) -> Any:
    """``value`` with numpy arrays and scalars as Python lists and numbers (a row as an episode reads it)."""
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


class _Failure(Exception):
    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause


def _reward(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise _Failure("not_a_number", f"returned {value!r:.200}, not a finite number")
    return float(value)


async def _function_episode(fn: Callable, url: str, key: str, row: dict, timeout: float) -> float:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=timeout)
    try:
        return _reward(await fn(client, row))
    except openai.NotFoundError as err:
        if getattr(err, "code", None) == "model_not_found":
            raise _Failure("wrong_model", str(err)) from None
        raise
    finally:
        await client.close()


async def _command_episode(command: str, url: str, key: str, model: str, row: dict) -> float:
    env = {**os.environ, "OPENAI_BASE_URL": url, "OPENAI_API_KEY": key, "OPENAI_MODEL": model,
           "POSTTRAIN_ROW": json.dumps(row, default=str)}
    proc = await asyncio.create_subprocess_shell(command, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = await proc.communicate()
    except BaseException:  # cancelled at the time-out: the program and its children end with it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        raise
    if proc.returncode != 0:
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        raise _Failure("exit_nonzero", f"exited with status {proc.returncode}: {tail[0][:300]}")
    lines = [line for line in out.decode("utf-8", "replace").splitlines() if line.strip()]
    try:
        return _reward(float(lines[-1].strip()) if lines else None)
    except ValueError:
        raise _Failure("not_a_number", f"its last line {lines[-1][:200]!r} is not a number") from None


async def _one(program: EpisodeProgram, url: str, key: str, model: str, row: dict, timeout: float) -> Outcome:
    start = time.monotonic()
    if program.fn is not None:
        call = functools.partial(_function_episode, program.fn, url, key, row, timeout)
    else:
        call = functools.partial(_command_episode, program.command, url, key, model, row)
    try:
        reward = await run_user_code(call, timeout=timeout, what=f"episode {program.where}")
        return Outcome(reward, seconds=time.monotonic() - start)
    except UserCodeTimeout as err:
        failure, message = "timeout", str(err)
    except _Failure as err:
        failure, message = err.cause, str(err)
    except Exception as err:  # noqa: BLE001 - the episode's bug is counted, never the run's end
        failure, message = "raised", f"{type(err).__name__}: {err}"
    return Outcome(None, failure, message[:500], time.monotonic() - start)


def run_episodes(program: EpisodeProgram, jobs: list[tuple[str, dict]], *, url: str, model: str, timeout_s: float,
                 max_concurrent: int) -> list[Outcome]:
    """Run one episode per ``(key, row)``, at most ``max_concurrent`` at once; their outcomes in order."""

    async def drive() -> list[Outcome]:
        limit = asyncio.Semaphore(max(1, int(max_concurrent)))

        async def one(key: str, row: dict) -> Outcome:
            async with limit:
                return await _one(program, url, key, model, row, float(timeout_s))

        return await asyncio.gather(*(one(key, row) for key, row in jobs))

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(drive())
    finally:
        loop.close()
