"""`posttrain plan`'s reward section: where the score comes from (rule, DisRM, GenRM server, GenRM URL),
which manager calls the function, what the judge runs on, and the limits a row and the judge live under.

Nothing is imported from the user's files: whether the function is ``async def`` is read from its source
(`ast`), and a manager class named by ``reward.reward_manager.module.path`` is checked at start-up.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Optional

from posttrain.config.reward_tree import RewardSettings, reward_settings
from posttrain.config.schema import PostTrainConfig

__all__ = ["reward_plan", "render_reward"]


def _is_async(path: Optional[str], name: str) -> Optional[bool]:
    """Whether ``name`` in ``path`` is ``async def`` (None: the file or the function is not found)."""
    try:
        tree = ast.parse(Path(path).expanduser().read_text())
    except (OSError, SyntaxError, ValueError, TypeError):
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return isinstance(node, ast.AsyncFunctionDef)
    return None


def _manager_problem(s: RewardSettings) -> Optional[str]:
    if s.manager_source != "register" or s.module_path:
        return None  # the user's file: imported at start-up
    from posttrain.rewards.loop import REWARD_MANAGERS

    if s.manager_name not in REWARD_MANAGERS:
        return (f"{s.manager_key}={s.manager_name!r} is not a registered reward manager; registered: "
                f"{sorted(REWARD_MANAGERS)}")
    return None


def _judge(config: PostTrainConfig, s: RewardSettings) -> dict[str, Any]:
    rm = config.reward.reward_model
    if s.judge_url:
        return {"where": f"the endpoint {s.judge_url} (already serving; checked with GET /models at start-up)",
                "resources": "none of this run's"}
    ranks = config.trainer.nnodes * config.trainer.n_gpus_per_node
    engine = f"posttrain serve, {rm.rollout.name} engine, {rm.rollout.dtype} (float32 on a CPU without bf16)"
    if ranks > 1 and rm.enable_resource_pool:
        devices = rm.nnodes * rm.n_gpus_per_node
        where = f"a Ray actor of its own ({engine})"
        resources = (f"its own resource pool: {devices} CPU(s)" if config.trainer.device == "cpu"
                     else "its own resource pool: 1 GPU (one server; tensor parallelism is not applied)")
    else:
        host = "the driver process (Ray ranks send their responses there to be scored)" if ranks > 1 else "this process"
        where = f"{host} on 127.0.0.1 ({engine})"
        resources = ("the trainer's own (the judge's weights and KV cache come on top of the memory estimate below)"
                     + ("; enable_resource_pool applies to Ray ranks" if rm.enable_resource_pool else ""))
    return {"where": where, "model": s.model_path, "resources": resources,
            "batch": f"up to {min(rm.rollout.max_num_seqs, 64)} requests decoded together, answers of at most "
                     f"{rm.rollout.response_length} tokens unless a request asks fewer"}


def reward_plan(config: PostTrainConfig) -> dict[str, Any]:
    """The reward section as a dict (``posttrain plan --json``: ``reward``)."""
    s, r = reward_settings(config), config.reward
    is_async = _is_async(s.function_path, s.function_name) if s.function_path else False
    loop = s.uses_reward_loop(bool(is_async))
    function = (f"{s.function_name} in {s.function_path} (from {s.function_key})" if s.function_path
                else f"the built-in scorers chosen by data.{config.data.reward_fn_key}")
    if is_async:
        function += ", async def"
    if s.served:
        function += "; receives reward_router_address and reward_model_tokenizer"
    out: dict[str, Any] = {"source": s.source, "function": function, "reward_loop": loop}
    if loop:
        out["manager"] = (f"{s.manager_name} ({'class ' + s.module_name + ' in ' + s.module_path if s.module_path else 'registered'}"
                          f", from {s.manager_key}), verl 0.9's reward loop: every row of a step scored concurrently")
    else:
        workers = f"{r.num_workers} worker processes" if r.num_workers else "in this process"
        out["manager"] = f"{s.manager_name} (posttrain's RewardManager, {workers})"
    if s.disrm:
        out["model"] = (f"{config.reward_model.model.path}: a sequence classifier on the workers; its score "
                        f"{'replaces' if config.reward_model.combine == 'replace' else 'is added to'} the function's")
    limits = [f"{r.timeout_s:g} s a row (reward.timeout_s)" if r.timeout_s else "no time-out (reward.timeout_s=null)",
              f"a failed row: {'the run stops, naming it' if r.on_error == 'raise' else 'scored 0, counted'} "
              f"(reward.on_error={r.on_error})"]
    if loop and s.manager_name in ("limit", "rate_limited"):
        limits.append(f"limit manager: {r.max_concurrent or 1} row(s) at once"
                      + (f", {r.max_rpm:g} requests/min" if r.max_rpm else "")
                      + (f", {r.max_tpm:g} tokens/min ({r.estimated_tokens_per_request} a row)" if r.max_tpm else ""))
    if s.served:
        out["judge"] = _judge(config, s)
        concurrent = r.max_concurrent or (8 if s.judge_url else 64)
        limits.append(f"judge requests: {concurrent} in flight, {f'{r.timeout_s:g}' if r.timeout_s else 'no limit of'} s each "
                      "with retries"
                      + (f", {r.max_rpm:g}/min" if r.max_rpm else "") + "; identical requests answered once (cache)")
    out["limits"] = limits
    problem = _manager_problem(s) if loop else None
    if problem:
        out["problem"] = problem
    return out


def render_reward(reward: dict[str, Any]) -> list[str]:
    lines = ["Reward", f"  {'source':<14}{reward['source']}", f"  {'function':<14}{reward['function']}",
             f"  {'manager':<14}{reward['manager']}"]
    if "model" in reward:
        lines.append(f"  {'model':<14}{reward['model']}")
    judge = reward.get("judge")
    if judge:
        lines.append(f"  {'judge':<14}{(judge['model'] + ', ') if judge.get('model') else ''}{judge['where']}")
        lines.append(f"  {'resources':<14}{judge['resources']}" + (f"; {judge['batch']}" if judge.get("batch") else ""))
    lines += [f"  {'limits' if i == 0 else '':<14}{text}" for i, text in enumerate(reward["limits"])]
    return lines
