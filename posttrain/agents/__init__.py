"""Agent programs trained through an OpenAI-compatible endpoint, with token-exact trajectories.

- :mod:`posttrain.agents.episode`: the user's ``async def episode(client, row) -> float`` (or a program),
  loaded and checked before any model loads; episodes run concurrently with time-outs, failures counted.
- :mod:`posttrain.agents.sessions`: the server's side: a key per episode, the run's sampling, the token
  budget, history kept as tokens, each answered call recorded.
- :mod:`posttrain.agents.assemble`: the calls' ids joined into training sequences; splits and retokenised
  tokens counted.
- :mod:`posttrain.agents.rollout`: :class:`AgentRollout`, the rollout phase (the batch every estimator reads).
"""

__all__ = ["AgentRollout", "agent_scores", "agent_step_metrics", "check_agent_setup", "agent_enabled"]


def __getattr__(name):
    if name in ("AgentRollout", "agent_scores", "agent_step_metrics"):
        from posttrain.agents import rollout

        return getattr(rollout, name)
    if name in ("check_agent_setup", "agent_enabled"):
        from posttrain.agents import episode

        return getattr(episode, name)
    raise AttributeError(f"module 'posttrain.agents' has no attribute {name!r}")
