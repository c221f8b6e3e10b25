"""User reward functions loaded from a file (``custom_reward_function.path`` / ``.name``).

The function is called as ``fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...,
**reward_kwargs)`` and returns a float, or a dict with ``"score"`` plus extra per-row fields.
Problems are reported when the function is loaded, not at the first training step.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
from typing import Any

from posttrain.errors import ConfigError, SignalStop

__all__ = ["load_custom_reward_fn", "CustomRewardFn", "REQUIRED_PARAMS"]

REQUIRED_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")


class RewardFunctionError(ConfigError):
    """``custom_reward_function`` cannot be used: no file, does not import, no such function, wrong
    signature. Each case is also the built-in type it used to be (FileNotFoundError, ...)."""


class RewardFileNotFound(RewardFunctionError, FileNotFoundError):
    pass


class RewardImportError(RewardFunctionError, RuntimeError):
    pass


class RewardNameError(RewardFunctionError, AttributeError):
    pass


class RewardSignatureError(RewardFunctionError, TypeError):
    pass


def _load_function(path: str, name: str):
    if not path:
        raise RewardFunctionError("custom_reward_function.path is empty")
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise RewardFileNotFound(f"custom_reward_function.path={path!r}: file not found ({full})")
    if not name:
        raise RewardFunctionError(f"custom_reward_function.name is empty (path={path!r})")
    # A stable, unique module name per file, so pickling by reference works in forked workers.
    mod_name = "posttrain_custom_reward_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    module = sys.modules.get(mod_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(mod_name, full)
        if spec is None or spec.loader is None:
            raise RewardFunctionError(f"custom_reward_function.path={path!r}: not a Python file that can be imported")
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except BaseException as e:  # SystemExit from a script-style file too
            if isinstance(e, (KeyboardInterrupt, SignalStop)):
                raise
            raise RewardImportError(
                f"custom_reward_function.path={path!r}: importing it failed: {type(e).__name__}: {e}"
            ) from e
        sys.modules[mod_name] = module
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardNameError(f"custom_reward_function.name={name!r} is not defined in {path}; callables there: {found}")
    if not callable(fn):
        raise RewardSignatureError(f"custom_reward_function.name={name!r} in {path} is a {type(fn).__name__}, not a function")
    return fn


def _check_signature(fn, path: str, name: str, reward_kwargs: dict) -> None:
    if inspect.iscoroutinefunction(fn):
        raise RewardSignatureError(f"custom reward function {name!r} in {path} is async; write a plain function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: trust them
    params = sig.parameters
    P = inspect.Parameter
    has_var_kw = any(p.kind is P.VAR_KEYWORD for p in params.values())
    keywordable = {n for n, p in params.items() if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    missing = [p for p in (*REQUIRED_PARAMS, *reward_kwargs) if p not in keywordable and not has_var_kw]
    unfilled = [
        n
        for n, p in params.items()
        if p.default is P.empty
        and p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY, P.POSITIONAL_ONLY)
        and n not in REQUIRED_PARAMS
        and n not in reward_kwargs
    ]
    if missing or unfilled:
        problems = []
        if missing:
            problems.append(f"does not accept {missing}")
        if unfilled:
            problems.append(f"requires {unfilled}, which the reward manager does not pass")
        raise RewardSignatureError(
            f"custom reward function {name!r} in {path} has signature {name}{sig}: it {' and '.join(problems)}. "
            "Expected def fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs)"
        )


class CustomRewardFn:
    """A loaded user function plus ``reward_kwargs``; picklable for spawned worker processes
    (it pickles as ``(path, name, reward_kwargs)`` and reloads the file on the other side)."""

    def __init__(self, path: str, name: str, reward_kwargs: dict | None = None):
        self.path, self.name, self.reward_kwargs = path, name, dict(reward_kwargs or {})
        self.fn = _load_function(path, name)
        _check_signature(self.fn, path, name, self.reward_kwargs)

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None, **kwargs: Any):
        return self.fn(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
            **{**kwargs, **self.reward_kwargs},
        )

    def __getstate__(self):
        return {"path": self.path, "name": self.name, "reward_kwargs": self.reward_kwargs}

    def __setstate__(self, state):
        self.__init__(state["path"], state["name"], state["reward_kwargs"])

    def __repr__(self) -> str:
        return f"CustomRewardFn(path={self.path!r}, name={self.name!r}, reward_kwargs={self.reward_kwargs})"


def load_custom_reward_fn(
    path: str | None, name: str | None, reward_kwargs: dict | None = None
) -> CustomRewardFn | None:
    """The user function from ``custom_reward_function`` (``name`` defaults to ``compute_score``, as in
    verl); ``None`` when ``path`` is unset (use the defaults).

    Raises ``FileNotFoundError`` (no file), ``AttributeError`` (no such name), ``TypeError`` (wrong
    signature), ``RuntimeError`` (the file fails to import), each naming the config key.
    """
    if not path:
        return None
    return CustomRewardFn(path, name or "compute_score", reward_kwargs)
