"""verl 0.9's reward loop: reward managers that score one row at a time with ``async def run_single``, all
rows of a batch concurrently, and a registry for the user's own (``reward.reward_manager.*``).

    manager = build_reward_manager(tokenizer, name="limit", compute_score=fn, max_concurrent=4, timeout_s=20)
    token_level_scores, extra = manager(batch)     # as posttrain's RewardManager: [N, R] float32, per-row extra
    manager.step_metrics()                          # reward/timeouts, reward/judge_* since the last call

Managers (``@register``\\ ed by name, as verl's):

- ``naive``: decode, score, ``{"acc": score}`` for a plain number (a dict result's fields otherwise).
- ``gdpo``: ``naive`` with ``extra_info["experiment_name"]`` (verl's, for gdpo's multi-part rewards).
- ``dapo``: ``naive`` plus DAPO's overlong penalty (:func:`posttrain.rewards.manager.overlong_penalty`).
- ``limit`` (verl's code registers it as ``rate_limited``; both names work): at most ``max_concurrent``
  rows scored at once, ``max_rpm`` requests and ``max_tpm`` estimated tokens a minute; a row's time-out
  runs from when it gets its slot, so waiting for the limits never counts against it.
- ``remote``: a pool of ``num_workers`` processes (spawned) scores the rows; for CPU-heavy sync scorers
  (math-verify). A row stuck in C code past its time-out gets its worker killed, and the pool restarts.

The scoring function is sync or ``async def`` (detected): async functions are awaited on the manager's
event loop (a background thread), sync ones run in a thread pool (``remote``: in the worker processes).
When a reward model is served (``reward_router_address`` given) each call also receives
``reward_router_address`` and ``reward_model_tokenizer`` (verl's GenRM functions).

posttrain's rules on top of verl's: every row gets ``timeout_s`` (``reward.timeout_s``); a row that raises,
times out or scores nan/inf is handled per ``on_error`` (``reward.on_error``): ``raise`` stops with one
error naming the row, its data_source and the function; ``zero`` scores it 0 and marks it in
``extra["reward/errors"]``. (A sync function that hangs keeps its thread until it returns: the row is
scored at the time-out, and the thread is left behind; ``remote`` kills such a worker instead.)

A user's manager subclasses :class:`RewardManagerBase` and writes ``async def run_single(self, data)``
(``data``: a one-row Batch; ``data[0].batch["responses"]``, ``data[0].non_tensor_batch["data_source"]``,
as verl's DataProto) returning ``{"reward_score": float, "reward_extra_info": dict}``; it may override
``async def run_batch(self, data) -> list[dict]`` to see the whole batch at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import math
import multiprocessing
import numbers
import os
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

from posttrain.batch import Batch, response_mask_of
from posttrain.errors import ConfigError
from posttrain.rewards.dispatch import default_compute_score
from posttrain.rewards.functions import GENRM_PARAMS, is_async
from posttrain.rewards.manager import (ERRORS_KEY, OverlongBuffer, RewardError, _scoring, _stack_extra,
                                       overlong_penalty, place_on_last_token)

__all__ = ["REWARD_MANAGERS", "RewardManagerBase", "NaiveRewardManager", "GDPORewardManager", "DAPORewardManager",
           "RateLimitedRewardManager", "RemoteRewardManager", "register", "get_reward_manager_cls",
           "resolve_reward_manager_cls", "build_reward_manager"]

REWARD_MANAGERS: dict[str, type] = {}
"""Registered reward managers by name (:func:`register`)."""


def register(name: str) -> Callable[[type], type]:
    """Class decorator: the manager is ``reward.reward_manager.name=<name>``. Registering another class under a
    taken name is an error (the same class twice is not: a module imported twice)."""

    def decorator(cls: type) -> type:
        taken = REWARD_MANAGERS.get(name)
        if taken is not None and taken is not cls and _qualname(taken) != _qualname(cls):
            raise ValueError(f"reward manager {name!r} is already registered to {_qualname(taken)}; "
                             f"cannot register {_qualname(cls)} under the same name")
        REWARD_MANAGERS[name] = cls
        return cls

    return decorator


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def get_reward_manager_cls(name: str) -> type:
    """The class registered as ``name``; ConfigError listing the registered names otherwise."""
    if name not in REWARD_MANAGERS:
        raise ConfigError(f"reward.reward_manager.name={name!r} is not a registered reward manager; registered: "
                          f"{sorted(REWARD_MANAGERS)} (a manager of your own: @register('{name}') in a file named "
                          "by reward.reward_manager.module.path)")
    return REWARD_MANAGERS[name]


def _import_module(path: str):
    """A ``.py`` file (by path) or an importable module name."""
    full = os.path.abspath(os.path.expanduser(path))
    if path.endswith(".py") or os.path.sep in path:
        if not os.path.isfile(full):
            raise ConfigError(f"reward.reward_manager.module.path={path!r}: file not found ({full})")
        name = "posttrain_reward_manager_" + str(abs(hash(full)))
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, full)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[name]
            raise ConfigError(f"reward.reward_manager.module.path={path!r}: importing it failed: "
                              f"{type(err).__name__}: {err}") from None
        return module
    try:
        return importlib.import_module(path)
    except ImportError as err:
        raise ConfigError(f"reward.reward_manager.module.path={path!r}: {err}") from None


def resolve_reward_manager_cls(source: str = "register", name: str = "naive", module_path: str | None = None,
                               module_name: str | None = None) -> type:
    """The manager class from ``reward.reward_manager.{source, name, module.path, module.name}``.

    ``register``: the class registered as ``name``; a ``module.path`` is imported first, so the
    ``@register`` lines in it run. ``importlib``: the class ``module.name`` in the file ``module.path``,
    else the class ``name`` there (verl 0.9.1's loader reads ``name``)."""
    if source not in ("register", "importlib"):
        raise ConfigError(f"reward.reward_manager.source={source!r}; valid: 'register', 'importlib'")
    module = _import_module(module_path) if module_path else None
    if source == "register":
        return get_reward_manager_cls(name)
    if module is None:
        raise ConfigError("reward.reward_manager.source=importlib needs reward.reward_manager.module.path (the file "
                          "holding the manager class)")
    for candidate in (module_name, name):
        cls = getattr(module, candidate, None) if candidate else None
        if isinstance(cls, type):
            if not callable(getattr(cls, "run_single", None)) and not callable(getattr(cls, "run_batch", None)):
                raise ConfigError(f"{candidate} in {module_path} has no run_single: a reward manager subclasses "
                                  "posttrain.rewards.loop.RewardManagerBase and defines async def run_single(self, data)")
            return cls
    found = sorted(k for k, v in vars(module).items() if isinstance(v, type) and hasattr(v, "run_single"))
    raise ConfigError(f"reward.reward_manager.module.path={module_path!r} defines neither {module_name!r} "
                      f"(module.name) nor {name!r} (name); manager classes there: {found}")


class _LoopThread:
    """An event loop in a daemon thread: the manager's rows run there, whatever loop the caller has."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="posttrain-reward-loop", daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class RewardManagerBase:
    """verl 0.9's reward-loop manager, callable as posttrain's (module docstring).

    Args (verl's): ``config`` (the run's config, for a manager that reads its own keys), ``tokenizer``
    (decodes responses), ``compute_score`` (``None``: the built-in scorers by data_source),
    ``reward_router_address`` (``host:port`` of the served reward model) and ``reward_model_tokenizer``.
    posttrain's settings (:meth:`configure`): ``reward_fn_key``, ``on_error``, ``timeout_s``, ``max_threads``.
    """

    handles_timeout = False
    """True when ``run_single`` applies ``timeout_s`` itself (after waiting for limits)."""

    def __init__(self, config: Any = None, tokenizer: Any = None, compute_score: Callable | None = None,
                 reward_router_address: str | None = None, reward_model_tokenizer: Any = None, **settings: Any):
        self.config, self.tokenizer = config, tokenizer
        self.compute_score = compute_score if compute_score is not None else default_compute_score
        self.is_async_reward_score = is_async(self.compute_score)
        self.reward_router_address, self.reward_model_tokenizer = reward_router_address, reward_model_tokenizer
        self.reward_fn_key, self.on_error, self.timeout_s, self.max_threads = "data_source", "raise", 60.0, None
        self._runner: _LoopThread | None = None
        self._threads: ThreadPoolExecutor | None = None
        self._counts = {"timeouts": 0}
        self.configure(**settings)

    def configure(self, *, reward_fn_key: str | None = None, on_error: str | None = None,
                  timeout_s: float | None | str = "keep", max_threads: int | None = None) -> "RewardManagerBase":
        """posttrain's settings (``data.reward_fn_key``, ``reward.on_error``, ``reward.timeout_s``, threads for
        sync functions); returns the manager."""
        if on_error is not None:
            if on_error not in ("raise", "zero"):
                raise ConfigError(f"reward.on_error={on_error!r}; valid: 'raise', 'zero'")
            self.on_error = on_error
        if reward_fn_key is not None:
            self.reward_fn_key = reward_fn_key
        if timeout_s != "keep":
            self.timeout_s = float(timeout_s) if timeout_s else None
        if max_threads is not None:
            self.max_threads = int(max_threads)
        return self

    # ------------------------------------------------------------------ verl's interface
    async def run_single(self, data: Batch) -> dict:
        """One row (a one-row Batch) -> ``{"reward_score": float, "reward_extra_info": dict}``."""
        raise NotImplementedError

    async def run_batch(self, data: Batch) -> list[dict]:
        """Every row, concurrently, each under :meth:`_guarded` (its time-out and errors); override to score
        the whole batch in one call."""
        return await asyncio.gather(*(self._guarded(i, data[i:i + 1]) for i in range(len(data))))

    # ------------------------------------------------------------------ helpers for run_single
    def row_inputs(self, data: Batch) -> dict[str, Any]:
        """The keywords of a scoring call for the last row of ``data``, plus ``valid_response_length``."""
        item = data[len(data) - 1]
        responses = item.batch["responses"]
        if "attention_mask" in item.batch.keys():  # every valid response token, as verl (and RewardManager) reads
            mask = item.batch["attention_mask"][-responses.shape[-1]:]
        else:
            mask = response_mask_of(data[-1:])[0]
        ids = responses[mask.bool()].tolist()
        nt = item.non_tensor_batch
        for key in ("reward_model", self.reward_fn_key):
            if key not in nt:
                raise KeyError(f"the batch has no non-tensor key {key!r} needed for scoring; keys: {sorted(nt)}")
        rm = nt["reward_model"]
        if not isinstance(rm, dict) or "ground_truth" not in rm:
            raise KeyError(f"reward_model has no 'ground_truth' (got {rm!r})")
        extra = dict(nt.get("extra_info") or {})
        if "multi_turn/turns" in nt or "__num_turns__" in nt:
            extra.setdefault("num_turns", nt.get("__num_turns__", nt.get("multi_turn/turns")))
        if "reward_scores" in nt:
            extra.setdefault("rollout_reward_scores", nt["reward_scores"])
        return {"data_source": nt[self.reward_fn_key], "solution_str": self.tokenizer.decode(ids, skip_special_tokens=True),
                "ground_truth": rm["ground_truth"], "extra_info": extra, "valid_response_length": len(ids)}

    def genrm_kwargs(self) -> dict[str, Any]:
        if self.reward_router_address is None:
            return {}
        return {"reward_router_address": self.reward_router_address,
                "reward_model_tokenizer": self.reward_model_tokenizer}

    async def call_score(self, data_source, solution_str, ground_truth, extra_info, **kwargs: Any) -> Any:
        """The scoring function on one row: awaited when async, in a thread when sync."""
        kwargs = dict(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                      extra_info=extra_info, **self.genrm_kwargs(), **kwargs)
        if self.is_async_reward_score:
            return await self.compute_score(**kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread_pool(), lambda: self.compute_score(**kwargs))

    @staticmethod
    def as_result(value: Any, record_acc: bool = True) -> dict:
        """A scoring function's return value as ``{"reward_score", "reward_extra_info"}`` (verl's rules: a dict
        gives its fields and must hold ``score``; a plain number is also recorded as ``acc``)."""
        if isinstance(value, dict):
            if "score" not in value:
                raise ValueError(f"the reward dict has no 'score' key: {sorted(value)}")
            return {"reward_score": value["score"], "reward_extra_info": dict(value)}
        return {"reward_score": value, "reward_extra_info": {"acc": value} if record_acc else {}}

    # ------------------------------------------------------------------ posttrain's side
    def _thread_pool(self) -> ThreadPoolExecutor:
        if self._threads is None:
            workers = self.max_threads or min(32, (os.cpu_count() or 1) + 4)
            self._threads = ThreadPoolExecutor(workers, thread_name_prefix="posttrain-reward")
        return self._threads

    async def _guarded(self, i: int, row: Batch) -> dict:
        """``run_single`` on one row under the row's time-out; a failure becomes ``{"error": message}``."""
        try:
            if self.timeout_s is None or self.handles_timeout:
                return await self.run_single(row)
            return await asyncio.wait_for(self.run_single(row), self.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            self._counts["timeouts"] += 1
            return {"error": f"timed out after {self.timeout_s:g} s (reward.timeout_s)"}
        except Exception as err:
            return {"error": f"{type(err).__name__}: {err}"}

    def _runner_thread(self) -> _LoopThread:
        if self._runner is None:
            self._runner = _LoopThread()
        return self._runner

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """``(token_level_scores [N, R] float32, extra)``: each row's score on its last valid response token;
        ``extra`` holds the rows' ``reward_extra_info`` fields and ``reward/errors`` (1.0 where a row failed)."""
        with _scoring():
            future = self._runner_thread().run(self.run_batch(batch))
            try:
                results = future.result()
            except BaseException:  # a signal (RewardInterrupted, KeyboardInterrupt): stop the rows, end the workers
                future.cancel()
                self.close(kill=True)
                raise
        return self._assemble(batch, results)

    def _assemble(self, batch: Batch, results: list[dict]) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        n = len(batch)
        if len(results) != n:
            raise RewardError(f"reward manager {type(self).__name__} returned {len(results)} results for {n} rows")
        scores = torch.zeros(n, dtype=torch.float64)
        errors = np.zeros(n, dtype=np.float64)
        rows: list[dict] = [{} for _ in range(n)]
        sources = batch.non_tensor_batch.get(self.reward_fn_key)
        for i, result in enumerate(results):
            problem = result.get("error") if isinstance(result, dict) else f"run_single returned {result!r}"
            value = result.get("reward_score") if not problem else None
            if not problem and not _finite(value):
                problem = f"the reward is {value!r}, not a finite number"
            if problem:
                if self.on_error == "raise":
                    source = sources[i] if sources is not None else None
                    raise RewardError(f"reward function {_function_name(self.compute_score)} ({type(self).__name__}) "
                                      f"failed on row {i} (data_source={source!r}): {problem}; reward.on_error=zero "
                                      "scores such rows 0 and counts them")
                errors[i] = 1.0
                rows[i] = {"acc": 0.0} if "acc" in _first_extra(results) else {}
                continue
            scores[i] = float(value)
            rows[i] = {k: (float(v) if isinstance(v, (bool, np.bool_)) else v)
                       for k, v in (result.get("reward_extra_info") or {}).items()}
        extra = _stack_extra(rows, n)
        extra[ERRORS_KEY] = errors
        return place_on_last_token(scores, response_mask_of(batch)), extra

    def step_metrics(self, reset: bool = True) -> dict[str, float]:
        """``reward/timeouts`` (rows past ``timeout_s``) and the process's ``reward/judge_*`` counters since the
        last call (``reset``)."""
        out = {"reward/timeouts": float(self._counts["timeouts"])}
        if reset:
            self._counts["timeouts"] = 0
        judge = sys.modules.get("posttrain.rewards.judge")
        if judge is not None:
            out.update(judge.judge_metrics(reset=reset))
        return out

    def close(self, kill: bool = False) -> None:
        """Stop the manager's event loop and threads (a later call starts them again)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.stop()
        threads, self._threads = self._threads, None
        if threads is not None:
            threads.shutdown(wait=False, cancel_futures=True)

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


def _finite(value: Any) -> bool:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.number)):
        return False
    return math.isfinite(float(value))


def _first_extra(results: list[dict]) -> dict:
    return next((r.get("reward_extra_info") or {} for r in results if isinstance(r, dict) and "error" not in r), {})


def _function_name(fn: Callable) -> str:
    path = getattr(fn, "path", None)
    name = getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"{name} (in {path})" if path else str(name)


@register("naive")
class NaiveRewardManager(RewardManagerBase):
    """Decode, score, done (verl's ``naive``)."""

    async def run_single(self, data: Batch) -> dict:
        row = self.row_inputs(data)
        row.pop("valid_response_length")
        return self.as_result(await self.call_score(**row))


@register("gdpo")
class GDPORewardManager(NaiveRewardManager):
    """``naive`` that also tells the function the run's name (verl 0.9.1's ``gdpo``: ``extra_info["experiment_name"]``);
    the function's dict of reward parts reaches the gdpo estimator by key (``algorithm.gdpo_reward_keys``)."""

    def row_inputs(self, data: Batch) -> dict[str, Any]:
        row = super().row_inputs(data)
        name = getattr(getattr(self.config, "trainer", None), "experiment_name", None)
        if name is not None:
            row["extra_info"]["experiment_name"] = name
        return row


@register("dapo")
class DAPORewardManager(RewardManagerBase):
    """``naive`` plus DAPO's overlong penalty (``overlong``: an :class:`OverlongBuffer`, or None)."""

    def __init__(self, config: Any = None, tokenizer: Any = None, compute_score: Callable | None = None,
                 reward_router_address: str | None = None, reward_model_tokenizer: Any = None, *,
                 overlong: OverlongBuffer | None = None, **settings: Any):
        super().__init__(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer, **settings)
        self.overlong = overlong

    async def run_single(self, data: Batch) -> dict:
        row = self.row_inputs(data)
        length = row.pop("valid_response_length")
        row["extra_info"] = dict(data[len(data) - 1].non_tensor_batch.get("extra_info") or {})  # verl's dapo: as given
        result = self.as_result(await self.call_score(**row))
        if self.overlong is not None and _finite(result["reward_score"]):
            penalty = float(overlong_penalty(torch.tensor([length]), self.overlong)[0])
            result["reward_score"] = float(result["reward_score"]) + penalty
            if self.overlong.log:
                result["reward_extra_info"].update(overlong_reward=penalty, overlong=float(penalty < 0))
        return result


class _TokenBucket:
    """``rate`` units a second, ``burst`` at once; ``take(k)`` waits until ``k`` units are there (a request
    larger than the bucket waits for its deficit and leaves the bucket negative, as verl's)."""

    def __init__(self, rate: float, burst: float | None = None):
        self.rate, self.capacity = float(rate), float(burst or rate)
        self.level, self.stamp = self.capacity, None
        self.lock: asyncio.Lock | None = None

    async def take(self, amount: float = 1.0) -> None:
        if self.lock is None:
            self.lock = asyncio.Lock()
        async with self.lock:  # one waiter at a time: first come, first served
            loop = asyncio.get_running_loop()
            now = loop.time()
            self.stamp = now if self.stamp is None else self.stamp
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now
            wait = max(0.0, (min(amount, self.capacity) - self.level) / self.rate)
            if amount > self.capacity:
                wait = max(wait, (amount - self.level) / self.rate)
            self.level -= amount
            if wait > 0:
                await asyncio.sleep(wait)


@register("limit")
@register("rate_limited")
class RateLimitedRewardManager(NaiveRewardManager):
    """``naive`` with limits (verl's ``rate_limited``; ``limit`` in verl's docs), for judges behind rate-limited
    APIs: ``max_concurrent`` rows at once, ``max_rpm`` requests and ``max_tpm`` tokens a minute (each row
    counts ``estimated_tokens_per_request``). A row's ``timeout_s`` starts when it has its slot."""

    handles_timeout = True

    def __init__(self, config: Any = None, tokenizer: Any = None, compute_score: Callable | None = None,
                 reward_router_address: str | None = None, reward_model_tokenizer: Any = None, *,
                 max_concurrent: int = 1, max_rpm: float | None = None, max_tpm: float | None = None,
                 estimated_tokens_per_request: int = 2000, **settings: Any):
        super().__init__(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer, **settings)
        if max_concurrent < 1:
            raise ConfigError(f"the limit reward manager's max_concurrent must be >= 1, got {max_concurrent}")
        self.max_concurrent, self.max_rpm, self.max_tpm = int(max_concurrent), max_rpm, max_tpm
        self.estimated_tokens_per_request = int(estimated_tokens_per_request)
        self._limits: tuple | None = None

    def _limiters(self):
        loop = asyncio.get_running_loop()
        if self._limits is None or self._limits[0] is not loop:
            self._limits = (loop, asyncio.Semaphore(self.max_concurrent),
                            _TokenBucket(self.max_rpm / 60.0) if self.max_rpm else None,
                            _TokenBucket(self.max_tpm / 60.0) if self.max_tpm else None)
        return self._limits[1:]

    async def run_single(self, data: Batch) -> dict:
        slots, rpm, tpm = self._limiters()
        if rpm is not None:
            await rpm.take(1.0)
        if tpm is not None:
            await tpm.take(float(self.estimated_tokens_per_request))
        async with slots:
            run = super().run_single(data)
            if self.timeout_s is None:
                return await run
            try:
                return await asyncio.wait_for(run, self.timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                self._counts["timeouts"] += 1
                return {"error": f"timed out after {self.timeout_s:g} s (reward.timeout_s), once its slot came"}


@register("remote")
class RemoteRewardManager(RewardManagerBase):
    """Rows scored in ``num_workers`` spawned processes (verl's ``remote``: CPU-heavy sync scorers). The
    function must be picklable (a :class:`posttrain.rewards.functions.RewardFunction`, a module-level
    function); ``async def`` functions are refused, as in verl."""

    handles_timeout = True  # the worker's alarm, from when the row starts there (not while it waits for a worker)

    def __init__(self, config: Any = None, tokenizer: Any = None, compute_score: Callable | None = None,
                 reward_router_address: str | None = None, reward_model_tokenizer: Any = None, *,
                 num_workers: int = 2, mp_context: str = "spawn", **settings: Any):
        super().__init__(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer, **settings)
        if self.is_async_reward_score:
            raise ConfigError("reward.reward_manager.name=remote runs sync reward functions in worker processes; "
                              f"{_function_name(self.compute_score)} is async: use naive or limit for it")
        self.num_workers, self.mp_context = max(1, int(num_workers)), mp_context
        self._pool: ProcessPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def _workers(self) -> ProcessPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                from posttrain.rewards._remote import init_worker

                self._pool = ProcessPoolExecutor(self.num_workers, mp_context=multiprocessing.get_context(self.mp_context),
                                                 initializer=init_worker, initargs=(self.compute_score, self.genrm_kwargs()))
            return self._pool

    def _free_worker(self) -> asyncio.Semaphore:
        """A row goes to the pool only when a worker is free, so its deadline never counts time in the queue."""
        loop = asyncio.get_running_loop()
        if getattr(self, "_free", None) is None or self._free[0] is not loop:
            self._free = (loop, asyncio.Semaphore(self.num_workers))
        return self._free[1]

    async def _started(self, pool: ProcessPoolExecutor) -> None:
        """Wait (no deadline) until every worker has started and loaded the function: start-up is not scoring."""
        from posttrain.rewards._remote import ready

        if getattr(self, "_warm", None) is not pool:
            await asyncio.gather(*(asyncio.wrap_future(pool.submit(ready)) for _ in range(self.num_workers)))
            self._warm = pool

    async def run_single(self, data: Batch) -> dict:
        from posttrain.rewards._remote import call

        row = self.row_inputs(data)
        row.pop("valid_response_length")
        async with self._free_worker():
            return await self._call(call, row)

    async def _call(self, call: Callable, row: dict) -> dict:
        pool = self._workers()
        try:
            await self._started(pool)
        except Exception as err:
            self._restart(pool)
            raise RuntimeError(f"the reward worker processes did not start: {type(err).__name__}: {err}") from None
        started = time.monotonic()
        future = asyncio.wrap_future(pool.submit(call, row, self.timeout_s))
        # the worker's own alarm ends a Python-level hang at timeout_s; this margin catches one stuck in C code
        margin = None if self.timeout_s is None else self.timeout_s + 5.0
        try:
            out = await asyncio.wait_for(future, margin)
        except (asyncio.TimeoutError, TimeoutError):
            self._restart(pool)
            self._counts["timeouts"] += 1
            return {"error": f"did not finish within {time.monotonic() - started:.0f} s; its worker was stopped"}
        except Exception as err:  # the worker died (killed, out of memory): the pool is broken, start a new one
            self._restart(pool)
            return {"error": f"its worker process failed: {type(err).__name__}: {err}"}
        _add_judge_counts(out[-1])
        if out[0] == "error":
            if "timed out" in out[1]:
                self._counts["timeouts"] += 1
            return {"error": out[1]}
        return self.as_result(out[1])

    def _restart(self, pool: ProcessPoolExecutor) -> None:
        with self._pool_lock:
            if self._pool is pool:
                self._pool = None
        _kill(pool)

    def close(self, kill: bool = False) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            _kill(pool) if kill else pool.shutdown(wait=False, cancel_futures=True)
        super().close(kill)


def _kill(pool: ProcessPoolExecutor) -> None:
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        if proc.is_alive():
            proc.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def _add_judge_counts(counts: dict[str, float]) -> None:
    """Judge counters moved in a worker process join this process's (:func:`judge.judge_metrics`)."""
    if not counts or not any(counts.values()):
        return
    from posttrain.rewards import judge

    judge.add_remote_counts(counts)


def build_reward_manager(tokenizer: Any, *, source: str = "register", name: str = "naive",
                         module_path: str | None = None, module_name: str | None = None,
                         compute_score: Callable | None = None, config: Any = None,
                         reward_router_address: str | None = None, reward_model_tokenizer: Any = None,
                         reward_fn_key: str = "data_source", on_error: str = "raise", timeout_s: float | None = 60.0,
                         num_workers: int = 0, overlong: OverlongBuffer | None = None,
                         limits: dict[str, Any] | None = None) -> RewardManagerBase:
    """The run's reward manager from plain values (the trainer reads them from ``reward.*``).

    ``num_workers`` is the ``remote`` manager's pool size; ``overlong`` the ``dapo`` manager's buffer;
    ``limits`` the ``limit`` manager's ``max_concurrent``/``max_rpm``/``max_tpm``/``estimated_tokens_per_request``.
    A user's class is built with verl's arguments (``config, tokenizer, compute_score, reward_router_address,
    reward_model_tokenizer``), then given posttrain's settings with :meth:`RewardManagerBase.configure`."""
    cls = resolve_reward_manager_cls(source, name, module_path, module_name)
    if compute_score is not None and reward_router_address is None and _needs_genrm(compute_score):
        raise ConfigError(f"reward function {_function_name(compute_score)} takes reward_router_address: serve a reward "
                          "model (reward.reward_model.enable=True, reward.reward_model.model_path=...)")
    kwargs: dict[str, Any] = {}
    if issubclass(cls, RemoteRewardManager):
        kwargs["num_workers"] = num_workers or 2
    if issubclass(cls, DAPORewardManager):
        kwargs["overlong"] = overlong
    if issubclass(cls, RateLimitedRewardManager):
        kwargs.update(limits or {})
    manager = cls(config=config, tokenizer=tokenizer, compute_score=compute_score,
                  reward_router_address=reward_router_address, reward_model_tokenizer=reward_model_tokenizer, **kwargs)
    if not hasattr(manager, "configure"):
        raise ConfigError(f"reward manager {_qualname(cls)} does not subclass posttrain.rewards.loop.RewardManagerBase")
    return manager.configure(reward_fn_key=reward_fn_key, on_error=on_error, timeout_s=timeout_s)


def _needs_genrm(fn: Callable) -> bool:
    try:
        params = inspect.signature(getattr(fn, "fn", fn)).parameters
    except (TypeError, ValueError):
        return False
    return any(n in params and params[n].default is inspect.Parameter.empty for n in GENRM_PARAMS)
