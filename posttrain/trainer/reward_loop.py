"""The run's reward through verl 0.9's reward loop (`posttrain.rewards.loop`), and the judge it asks.

`build_reward_fn` (`posttrain.trainer.setup`) comes here when the reward tree asks for it
(`RewardSettings.uses_reward_loop`): a served reward model (``reward.reward_model.enable``), a manager
other than naive/dapo or one loaded from a file, or an ``async def`` scoring function. Otherwise the
classic `RewardManager` scores, exactly as before.

A GenRM run (``reward.reward_model.enable=True`` with a scoring function) gets its judge before the first
step, each part checked with one line if it fails:

- ``model_path`` a model: it is loaded and served with ``posttrain serve``'s `CompletionServer` on
  127.0.0.1 in this process (on Ray ranks: the driver, where rewards are computed), or, on Ray ranks with
  ``enable_resource_pool=True``, in a Ray actor of its own holding ``nnodes x n_gpus_per_node`` devices
  (CPUs on a CPU run); ``model_path`` an ``http(s)://`` URL: an endpoint already serving, used as it is.
- the endpoint must answer ``GET /v1/models`` (a refused URL is an error, not a run of zero rewards);
- the scoring function receives ``reward_router_address`` (``host:port``, or the URL) and
  ``reward_model_tokenizer`` (the judge's tokenizer; None for a URL), as verl passes them;
- the process's judge client for that address (`posttrain.rewards.judge.judge_for`, which verl's
  ``chat_complete`` uses) gets the run's limits: ``reward.timeout_s`` per request (retries included),
  ``reward.on_error``, ``reward.max_concurrent`` requests in flight (null: 64 to the run's server, which
  batches them; 8 to a URL) and ``reward.max_rpm``; the same keys bound the ``limit`` manager.

The server stops when the run ends (`RewardLoop.close`, from the trainer's exit hook).
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any, Callable

from posttrain.config import ConfigError, PostTrainConfig
from posttrain.config.reward_tree import RewardSettings, reward_settings

__all__ = ["JudgeEndpoint", "RewardLoop", "build_reward_loop", "function_is_async", "start_judge", "step_metrics",
           "takes_function", "wants_reward_loop", "with_function"]


def function_is_async(settings: RewardSettings) -> bool:
    """Whether the configured scoring function is ``async def`` (its file is imported once, and kept)."""
    if not settings.function_path:
        return False
    from posttrain.rewards.custom import _load_function

    fn = _load_function(settings.function_path, settings.function_name)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def wants_reward_loop(config: PostTrainConfig) -> bool:
    s = reward_settings(config)
    return s.uses_reward_loop(function_is_async(s))


class RewardLoop:
    """The run's reward function: a reward-loop manager, called as the classic one (``batch ->
    (token_level_scores, extra)``), plus the judge it asks, stopped by :meth:`close`."""

    def __init__(self, manager: Any, *, source: str, judge: "JudgeEndpoint | None" = None,
                 restore_limits: dict | None = None):
        self.manager, self.source, self.judge = manager, source, judge
        self._restore_limits = restore_limits
        # the process's judge counters start at zero for this run: calls a judge made before it (another run in
        # this process, a notebook cell) would otherwise count in its first step's reward/judge_* metrics
        judge_module = sys.modules.get("posttrain.rewards.judge")
        if judge_module is not None:
            judge_module.judge_metrics(reset=True)

    def __call__(self, batch):
        return self.manager(batch)

    @property
    def compute_score(self) -> Callable:
        return self.manager.compute_score

    def step_metrics(self) -> dict[str, float]:
        """``reward/timeouts`` and ``reward/judge_*`` since the last step, and the judge server's batching."""
        out = self.manager.step_metrics()
        if self.judge is not None:
            out.update(self.judge.metrics())
        return out

    def close(self, kill: bool = False) -> None:
        self.manager.close(kill)
        if self.judge is not None:
            self.judge.stop()
            self.judge = None
        if self._restore_limits is not None:
            from posttrain.rewards import judge

            judge.set_default_limits(**self._restore_limits)
            self._restore_limits = None


def takes_function(trainer: Any, fn: Callable) -> bool:
    """Whether a per-row function given through the Python API (``trainer.reward_fn = fn``) goes to the reward
    loop: it is ``async def``, or the run already scores there (the function then asks the run's judge)."""
    from posttrain.rewards.functions import is_async

    return is_async(fn) or isinstance(getattr(trainer, "_reward_fn", None), RewardLoop)


def with_function(trainer: Any, fn: Callable) -> RewardLoop:
    """The run's reward loop scoring with ``fn``; a judge the run already serves is kept for it."""
    current = getattr(trainer, "_reward_fn", None)
    endpoint = None
    if isinstance(current, RewardLoop):
        endpoint, current.judge = current.judge, None
        current.close()
    return build_reward_loop(trainer.config, trainer.tokenizer, compute_score=fn, device=trainer.device.type,
                             endpoint=endpoint)


def step_metrics(reward_fn: Any) -> dict[str, float]:
    """The reward's own per-step counters (a `RewardLoop`'s), else nothing."""
    return reward_fn.step_metrics() if isinstance(reward_fn, RewardLoop) else {}


# ---------------------------------------------------------------------------------------------- the judge
class JudgeEndpoint:
    """Where the GenRM function's requests go: ``address`` (verl's ``reward_router_address``), the judge's
    ``tokenizer``, and what to stop at the end (a server in this process, a Ray actor, or nothing)."""

    def __init__(self, address: str, tokenizer: Any, model_name: str | None, where: str, *, server: Any = None,
                 actor: Any = None):
        self.address, self.tokenizer, self.model_name, self.where = address, tokenizer, model_name, where
        self._server, self._actor, self._batches = server, actor, 0

    def metrics(self) -> dict[str, float]:
        if self._server is None:
            return {}
        stats = dict(self._server.batcher.stats)
        batches = stats.get("batches", 0)
        new, self._batches = batches - self._batches, batches
        return {"reward/judge_server_batches": float(new)}

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()
        actor, self._actor = self._actor, None
        if actor is not None:
            import ray

            ray.kill(actor, no_restart=True)


def _check_answers(url: str, key: str, timeout_s: float) -> None:
    """ConfigError (one line) unless ``GET {url}/models`` answers with a model list."""
    import httpx

    from posttrain.rewards.judge import normalize_base_url

    base = normalize_base_url(url)
    try:
        response = httpx.get(f"{base}/models", timeout=timeout_s)
    except httpx.HTTPError as err:
        raise ConfigError(f"{key}: the judge at {base} does not answer GET /models ({type(err).__name__}: "
                          f"{str(err) or 'no detail'}); start it, or fix the URL") from None
    if response.status_code in (401, 403):
        raise ConfigError(f"{key}: the judge at {base} refused the request (HTTP {response.status_code}); set "
                          "POSTTRAIN_JUDGE_API_KEY to its key")
    try:
        models = [m["id"] for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        models = []
    if response.status_code != 200 or not models:
        raise ConfigError(f"{key}: {base}/models answered HTTP {response.status_code} without a model list; is it "
                          "an OpenAI-compatible endpoint?")


def _judge_dtype(rollout: Any, device: str) -> str:
    """The server's weights: the key's dtype, but float32 on a CPU without bf16 instructions."""
    dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(rollout.dtype, rollout.dtype)
    if device == "cpu" and dtype in ("bf16", "fp16"):
        from posttrain.host.cpu import cpu_bf16_support

        if not cpu_bf16_support()[0]:
            return "fp32"
    return dtype


def _server_options(config: PostTrainConfig) -> dict[str, Any]:
    rollout = config.reward.reward_model.rollout
    return {"max_model_len": rollout.max_model_len or rollout.prompt_length + rollout.response_length,
            "max_batch_rows": min(int(rollout.max_num_seqs), 64), "default_max_tokens": int(rollout.response_length)}


def _start_server_here(config: PostTrainConfig, path: str, device: str) -> JudgeEndpoint:
    from posttrain.serve.server import CompletionServer, build_engine

    rollout = config.reward.reward_model.rollout
    engine, tokenizer, _ = build_engine(rollout.name, path, dtype=_judge_dtype(rollout, device), device=device,
                                        trust_remote_code=config.actor_rollout_ref.model.trust_remote_code,
                                        max_model_len=rollout.max_model_len)
    name = os.path.basename(str(path).rstrip("/")) or str(path)
    server = CompletionServer(engine, tokenizer, model_name=name, **_server_options(config)).start()
    return JudgeEndpoint(server.address, tokenizer, name, f"served in this process at {server.url}", server=server)


class _ServerActor:
    """A Ray actor holding the judge's server (``enable_resource_pool=True`` on Ray ranks)."""

    def __init__(self, path: str, engine: str, dtype: str, device: str, trust_remote_code: bool, options: dict):
        import ray

        from posttrain.serve.server import CompletionServer, build_engine

        engine_, tokenizer, _ = build_engine(engine, path, dtype=dtype, device=device,
                                             trust_remote_code=trust_remote_code,
                                             max_model_len=options.get("max_model_len"))
        self.name = os.path.basename(str(path).rstrip("/")) or str(path)
        self.server = CompletionServer(engine_, tokenizer, model_name=self.name,
                                       host=ray.util.get_node_ip_address(), **options).start()

    def address(self) -> tuple[str, str]:
        return self.server.address, self.name


def _start_server_on_ray(config: PostTrainConfig, path: str) -> JudgeEndpoint:
    import ray
    from omegaconf import OmegaConf

    from posttrain.distributed.cluster import connect, resolve_device
    from posttrain.models import load_tokenizer

    rm = config.reward.reward_model
    ray_init = OmegaConf.to_container(OmegaConf.structured(config.ray_kwargs.ray_init), resolve=True)
    device = resolve_device(config.trainer.device)
    connect(ray_init, device)
    devices = rm.nnodes * rm.n_gpus_per_node
    resources = {"num_gpus": 1, "num_cpus": 1} if device == "cuda" else {"num_cpus": devices}
    actor = ray.remote(**resources)(_ServerActor).remote(
        path, rm.rollout.name, _judge_dtype(rm.rollout, device), device,
        config.actor_rollout_ref.model.trust_remote_code, _server_options(config))
    try:
        address, name = ray.get(actor.address.remote(), timeout=float(config.trainer.ray_wait_register_center_timeout))
    except Exception as err:
        ray.kill(actor, no_restart=True)
        first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise ConfigError(f"reward.reward_model.model_path={path}: the judge's server did not start in its Ray "
                          f"resource pool ({resources}): {first}") from None
    tokenizer = load_tokenizer(path, trust_remote_code=config.actor_rollout_ref.model.trust_remote_code)
    return JudgeEndpoint(address, tokenizer, name, f"served by a Ray actor of its own ({resources}) at {address}",
                         actor=actor)


def start_judge(config: PostTrainConfig, settings: RewardSettings, device: str) -> JudgeEndpoint:
    """The GenRM endpoint: the URL as it is, or the model served here or in its own Ray resource pool; each
    checked to answer before the first step."""
    key = f"reward.reward_model.model_path={settings.model_path}"
    timeout = min(30.0, float(config.reward.timeout_s or 30.0))
    if settings.judge_url:
        _check_answers(settings.judge_url, key, timeout)
        return JudgeEndpoint(settings.judge_url, None, None, f"the endpoint {settings.judge_url}")
    ranks = config.trainer.nnodes * config.trainer.n_gpus_per_node
    try:
        if ranks > 1 and config.reward.reward_model.enable_resource_pool:
            endpoint = _start_server_on_ray(config, settings.model_path)
        else:
            endpoint = _start_server_here(config, settings.model_path, device)
    except ConfigError as err:  # posttrain serve's own one line ("cannot load the model: ...")
        raise ConfigError(f"{key}: {str(err).split(': ', 1)[-1]}") from None
    try:
        _check_answers(endpoint.address, key, timeout)
    except ConfigError:
        endpoint.stop()
        raise
    return endpoint


# ---------------------------------------------------------------------------------------------- the manager
def _judge_limits(config: PostTrainConfig, endpoint: JudgeEndpoint | None) -> dict[str, Any]:
    r = config.reward
    rollout = r.reward_model.rollout
    limits: dict[str, Any] = {"timeout_s": r.timeout_s, "on_error": r.on_error,
                              "max_concurrent": r.max_concurrent or (64 if endpoint is not None and endpoint.model_name
                                                                     else 8),
                              "max_rps": r.max_rpm / 60.0 if r.max_rpm else None}
    if endpoint is not None and endpoint.model_name:  # the run's own server: verl's sampling defaults
        limits["defaults"] = {"temperature": rollout.temperature if rollout.do_sample else 0.0, "top_p": rollout.top_p}
    key = os.environ.get("POSTTRAIN_JUDGE_API_KEY")
    if key:
        limits["api_key"] = key
    return limits


def _overlong(config: PostTrainConfig):
    from posttrain.config.dapo import overlong_settings
    from posttrain.rewards.manager import OverlongBuffer

    s = overlong_settings(config)
    return OverlongBuffer(s.length, float(s.penalty_factor), s.max_len, s.log) if s.enable else None


def build_reward_loop(config: PostTrainConfig, tokenizer: Any, compute_score: Callable | None = None,
                      device: str = "cpu", endpoint: JudgeEndpoint | None = None) -> RewardLoop:
    """The reward-loop manager the config names, with its judge started (GenRM) and its limits set.
    ``compute_score``: a function given through the Python API instead of the configured file;
    ``endpoint``: a judge already started (kept)."""
    from posttrain.rewards import judge
    from posttrain.rewards.functions import load_reward_function
    from posttrain.rewards.loop import build_reward_manager, resolve_reward_manager_cls

    s, r = reward_settings(config), config.reward
    resolve_reward_manager_cls(s.manager_source, s.manager_name, s.module_path, s.module_name)  # a bad name: now
    if compute_score is None:
        compute_score = load_reward_function(s.function_path, s.function_name, genrm=s.served)
    if endpoint is None and s.served:
        endpoint = start_judge(config, s, device)
    previous = dict(judge._DEFAULT_LIMITS)
    try:
        limits = _judge_limits(config, endpoint)
        judge.set_default_limits(**limits)
        if endpoint is not None:
            judge._BY_ADDRESS.pop(judge.normalize_base_url(endpoint.address), None)
            judge.judge_for(endpoint.address, **({"model": endpoint.model_name} if endpoint.model_name else {}))
        manager = build_reward_manager(
            tokenizer, source=s.manager_source, name=s.manager_name, module_path=s.module_path,
            module_name=s.module_name, compute_score=compute_score, config=config,
            reward_router_address=endpoint.address if endpoint else None,
            reward_model_tokenizer=endpoint.tokenizer if endpoint else None, reward_fn_key=config.data.reward_fn_key,
            on_error=r.on_error, timeout_s=r.timeout_s, num_workers=r.num_workers, overlong=_overlong(config),
            limits={"max_concurrent": r.max_concurrent or 1, "max_rpm": r.max_rpm, "max_tpm": r.max_tpm,
                    "estimated_tokens_per_request": r.estimated_tokens_per_request})
    except BaseException:
        if endpoint is not None:
            endpoint.stop()
        judge.set_default_limits(**previous)
        raise
    print(f"reward: {describe(s, endpoint, manager)}", flush=True)
    return RewardLoop(manager, source=s.source, judge=endpoint, restore_limits=previous)


def describe(s: RewardSettings, endpoint: JudgeEndpoint | None, manager: Any) -> str:
    fn = f"{s.function_name} in {s.function_path}" if s.function_path else "the built-in scorers by data_source"
    where = f"; judge {endpoint.where}" if endpoint is not None else ""
    return f"{s.source} ({fn}) through the {s.manager_name} reward manager ({type(manager).__name__}){where}"
