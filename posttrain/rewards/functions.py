"""Reward functions for the reward loop (``reward.custom_reward_function.path/name``): plain or ``async def``,
detected when loaded, and GenRM functions as verl's docs write them.

    async def compute_score(data_source, solution_str, ground_truth, extra_info,
                            reward_router_address, reward_model_tokenizer): ...

Every function receives ``data_source``, ``solution_str``, ``ground_truth`` and ``extra_info`` as keywords,
plus the ``reward_kwargs``; when a reward model is served (``genrm=True``) also ``reward_router_address``
(``host:port`` of the server: ``http://<address>/v1/chat/completions``) and ``reward_model_tokenizer``.
A signature that cannot take what it will be given, or that needs something nobody gives (a GenRM
function without a reward model), is refused when loaded, naming the function and the key to set.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from posttrain.rewards.custom import REQUIRED_PARAMS, RewardSignatureError, _load_function

__all__ = ["GENRM_PARAMS", "RewardFunction", "is_async", "load_reward_function"]

GENRM_PARAMS = ("reward_router_address", "reward_model_tokenizer")


def is_async(fn: Callable) -> bool:
    """Whether calling ``fn`` gives an awaitable: an ``async def`` function (a :class:`RewardFunction` says)."""
    if isinstance(fn, RewardFunction):
        return fn.is_async
    target = getattr(fn, "func", fn)  # functools.partial
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(getattr(target, "__call__", None))


def check_signature(fn: Callable, label: str, given: tuple[str, ...]) -> None:
    """RewardSignatureError unless ``fn`` accepts every name in ``given`` and requires nothing else."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: trust them
    P = inspect.Parameter
    params = sig.parameters
    var_kw = any(p.kind is P.VAR_KEYWORD for p in params.values())
    named = {n for n, p in params.items() if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    missing = [n for n in given if n not in named and not var_kw]
    required = [n for n, p in params.items() if p.default is P.empty and n not in given
                and p.kind not in (P.VAR_KEYWORD, P.VAR_POSITIONAL)]
    if not missing and not required:
        return
    problems = []
    if missing:
        problems.append(f"does not accept {missing}")
    if required:
        needs_rm = [n for n in required if n in GENRM_PARAMS]
        hint = (" (only a served reward model gives them: reward.reward_model.enable=True with "
                "reward.reward_model.model_path)" if needs_rm else "")
        problems.append(f"requires {required}, which the reward manager does not pass{hint}")
    raise RewardSignatureError(f"reward function {label} has signature {sig}: it {' and '.join(problems)}; expected "
                               "fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs), plain or async")


class RewardFunction:
    """A user function loaded from ``path``/``name``, called with keywords plus ``reward_kwargs``; sync or async
    (``is_async``); picklable (as ``(path, name, reward_kwargs, genrm)``, reloaded on the other side)."""

    def __init__(self, path: str, name: str = "compute_score", reward_kwargs: dict | None = None, genrm: bool = False):
        self.path, self.name, self.genrm = path, name or "compute_score", bool(genrm)
        self.reward_kwargs = dict(reward_kwargs or {})
        self.fn = _load_function(path, self.name)
        self.is_async = is_async(self.fn)
        given = (*REQUIRED_PARAMS, *self.reward_kwargs, *(GENRM_PARAMS if self.genrm else ()))
        check_signature(self.fn, f"{self.name!r} in {path}", given)

    def __call__(self, **kwargs: Any) -> Any:
        return self.fn(**kwargs, **self.reward_kwargs)

    def __getstate__(self):
        return {"path": self.path, "name": self.name, "reward_kwargs": self.reward_kwargs, "genrm": self.genrm}

    def __setstate__(self, state):
        self.__init__(state["path"], state["name"], state["reward_kwargs"], state.get("genrm", False))

    def __repr__(self) -> str:
        return f"RewardFunction(path={self.path!r}, name={self.name!r}, async={self.is_async})"


def load_reward_function(path: str | None, name: str | None = "compute_score", reward_kwargs: dict | None = None,
                         genrm: bool = False) -> RewardFunction | None:
    """The function at ``reward.custom_reward_function.path/name`` (None when ``path`` is unset: the built-in
    scorers); ``genrm`` when a reward model is served (its address and tokenizer are passed too)."""
    if not path:
        return None
    return RewardFunction(path, name or "compute_score", reward_kwargs, genrm)
