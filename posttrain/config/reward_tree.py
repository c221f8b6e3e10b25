"""Where a run's reward comes from, read from both of verl's trees: the legacy top-level keys
(``custom_reward_function.*``, ``reward_model.reward_manager``, ``reward_model.enable``) and verl 0.9's
``reward.*`` tree.

verl 0.9.1 folds the legacy keys into ``reward.*`` before a run (``migrate_legacy_reward_impl``): a legacy
key that is set wins. posttrain reads the pair the same way, but where both keys are set to different
values it refuses the config, naming both keys and which one verl would use, instead of picking silently.

    settings = reward_settings(config)   # the effective function, manager and reward model
    settings.source                      # "rule", "DisRM", "GenRM server" or "GenRM URL"
    list(reward_tree_problems(config))   # the pairs that disagree, a GenRM without a model, ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

__all__ = ["LEGACY_PAIRS", "RewardSettings", "is_url", "reward_settings", "reward_tree_problems"]

LEGACY_PAIRS: tuple[tuple[str, str, Any], ...] = (
    ("custom_reward_function.path", "reward.custom_reward_function.path", None),
    ("custom_reward_function.name", "reward.custom_reward_function.name", "compute_score"),
    ("reward_model.reward_manager", "reward.reward_manager.name", "naive"),
    ("reward_model.sandbox_fusion.url", "reward.sandbox_fusion.url", None),
)
"""(legacy key, verl 0.9 key, the default both share): the same setting in the two trees."""

CLASSIC_MANAGERS = ("naive", "dapo")
"""Managers the classic path (``posttrain.rewards.manager.RewardManager``) runs as verl's do."""


def _get(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return config


def is_url(path: Optional[str]) -> bool:
    """``reward.reward_model.model_path`` names an endpoint already serving (``http(s)://...``), not a model."""
    return bool(path) and str(path).startswith(("http://", "https://"))


def _effective(config: Any, legacy: str, new: str, default: Any) -> tuple[Any, str]:
    """(value, the key it came from): the key that is set; both set alike or neither: the verl 0.9 key;
    both set differently: the legacy key (verl's migration copies it over; the check refuses the pair)."""
    old, now = _get(config, legacy), _get(config, new)
    if old != default and old != now:
        return old, legacy
    return now, new


@dataclass(frozen=True)
class RewardSettings:
    """The reward a run computes, with the key each part came from."""

    function_path: Optional[str]
    """The user's scoring function file (None: the built-in scorers by data_source)."""
    function_name: str
    function_key: str
    """The key that named the file (``custom_reward_function.path`` or ``reward.custom_reward_function.path``)."""
    manager_source: str
    manager_name: str
    manager_key: str
    """The key that named the manager (``reward_model.reward_manager`` or ``reward.reward_manager.name``)."""
    module_path: Optional[str]
    module_name: str
    served: bool
    """``reward.reward_model.enable``: a generative reward model behind an OpenAI-compatible server."""
    model_path: Optional[str]
    """``reward.reward_model.model_path``: the model the run serves, or a URL already serving one."""
    disrm: bool
    """``reward_model.enable``: posttrain's discriminative reward model on the workers (legacy keys)."""

    @property
    def judge_url(self) -> Optional[str]:
        return self.model_path if self.served and is_url(self.model_path) else None

    @property
    def source(self) -> str:
        """Where the score comes from: rule, DisRM, GenRM server (served by this run), GenRM URL."""
        if self.served:
            return "GenRM URL" if self.judge_url else "GenRM server"
        return "DisRM" if self.disrm else "rule"

    @property
    def classic_manager(self) -> bool:
        """naive or dapo, registered by name: what the classic reward manager runs bit for bit."""
        return self.manager_source == "register" and not self.module_path and self.manager_name in CLASSIC_MANAGERS

    def uses_reward_loop(self, function_is_async: bool) -> bool:
        """Whether the run scores with verl 0.9's reward-loop managers (``posttrain.rewards.loop``): a served
        reward model, a manager other than naive/dapo (or one loaded from a file), or an ``async def`` function."""
        return self.served or not self.classic_manager or function_is_async


def reward_settings(config: Any) -> RewardSettings:
    """The effective reward settings of a loaded config (``PostTrainConfig``)."""
    path, path_key = _effective(config, *LEGACY_PAIRS[0])
    name, _ = _effective(config, *LEGACY_PAIRS[1])
    manager, manager_key = _effective(config, *LEGACY_PAIRS[2])
    r = config.reward
    return RewardSettings(function_path=path, function_name=name or "compute_score", function_key=path_key,
                          manager_source=r.reward_manager.source, manager_name=manager, manager_key=manager_key,
                          module_path=r.reward_manager.module.path, module_name=r.reward_manager.module.name,
                          served=bool(r.reward_model.enable), model_path=r.reward_model.model_path,
                          disrm=bool(config.reward_model.enable))


def reward_tree_problems(config: Any) -> Iterable[str]:
    """One line per problem of the reward settings, before any model loads."""
    for legacy, new, default in LEGACY_PAIRS:
        old, now = _get(config, legacy), _get(config, new)
        if old != default and now != default and old != now:
            yield (f"{legacy}={old!r} and {new}={now!r} set the same thing differently; verl 0.9.1 would use "
                   f"{legacy} (the legacy key wins: its migrate_legacy_reward_impl copies it over {new}); set only one")
    r, s = config.reward, reward_settings(config)
    if s.served and s.disrm:
        yield ("reward_model.enable=True (a discriminative reward model on the workers) and reward.reward_model.enable="
               "True (a generative judge behind a server) are both on; keep one (a judge's function may add a rule "
               "score itself)")
    if s.served and not s.model_path:
        yield ("reward.reward_model.enable=True needs reward.reward_model.model_path: the judge model to serve (a "
               "folder, hub id or smollm2-135m-instruct) or the URL of an OpenAI-compatible endpoint (http://host:port/v1)")
    if s.served and not s.function_path:
        yield ("reward.reward_model.enable=True without reward.custom_reward_function.path: verl then treats the model "
               "as a discriminative scorer; posttrain runs that on the workers: set reward_model.enable=True "
               "reward_model.model.path=... instead, or give the GenRM function that asks the judge "
               "(async def compute_score(..., reward_router_address, reward_model_tokenizer))")
    if s.served and not s.judge_url and r.reward_model.rollout.name not in ("hf", "vllm"):
        yield (f"reward.reward_model.rollout.name={r.reward_model.rollout.name!r}: the judge is served by posttrain "
               "serve, which runs the hf or vllm engine")
    if r.reward_model.enable_resource_pool and r.reward_model.nnodes * r.reward_model.n_gpus_per_node < 1:
        yield (f"reward.reward_model.enable_resource_pool=True with reward.reward_model.nnodes="
               f"{r.reward_model.nnodes} x n_gpus_per_node={r.reward_model.n_gpus_per_node} = 0 devices; give the "
               "judge's pool at least one (e.g. reward.reward_model.nnodes=1 reward.reward_model.n_gpus_per_node=1)")
    for key in ("max_rpm", "max_tpm"):
        value = getattr(r, key)
        if value is not None and not value > 0:
            yield f"reward.{key}={value!r} must be > 0 (null: no limit)"
    if r.reward_manager.source not in ("register", "importlib"):
        yield f"reward.reward_manager.source={r.reward_manager.source!r} is not one of: register, importlib"


def disrm_from_reward_loop(config: Any) -> None:
    """verl 0.9's ``reward.reward_model.enable=True`` with no reward function is a discriminative reward model
    (verl scores with its sequence-classification head): posttrain runs that on its workers, the legacy
    ``reward_model.*`` path, so the loop's keys become those (in place; `posttrain config` shows the result)."""
    loop = config.reward.reward_model
    has_function = config.reward.custom_reward_function.path or config.custom_reward_function.path
    if not loop.enable or has_function or config.reward_model.enable or not loop.model_path:
        return
    rm = config.reward_model
    rm.enable, rm.model.path, loop.enable = True, loop.model_path, False
    if rm.micro_batch_size_per_gpu is None and rm.micro_batch_size is None and not rm.use_dynamic_bsz:
        # verl's served scorer batches by tokens: the same here, a pass holding the server's longest request
        rm.use_dynamic_bsz = True
        rm.forward_max_token_len_per_gpu = loop.rollout.prompt_length + loop.rollout.response_length
