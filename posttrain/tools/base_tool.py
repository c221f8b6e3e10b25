"""The tool interface (verl's ``BaseTool``): one object per configured tool, one *instance* per
trajectory that uses it.

The agent loop (``posttrain.rollout.multi_turn``) calls, for each trajectory::

    instance_id, _ = await tool.create(create_kwargs...)           # first call of this tool in the trajectory
    response, step_reward, metrics = await tool.execute(instance_id, arguments, execute_kwargs...)
    reward = await tool.calc_reward(instance_id, calc_reward_kwargs...)   # when the trajectory ends
    await tool.release(instance_id, release_kwargs...)

``create`` may return the id alone (verl's older form) or ``(id, ToolResponse)``; ``execute``'s
response may be a :class:`ToolResponse`, a string or a dict with ``text``. ``arguments`` is the
decoded JSON object of the call, already checked against the tool's schema.
"""

from __future__ import annotations

import uuid
from typing import Any

from posttrain.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["BaseTool"]


class BaseTool:
    """A tool with an OpenAI function schema. Subclasses override ``execute`` (and keep per-trajectory
    state keyed by instance id when they need it).

    Args:
        config: the tool's ``config`` mapping from the tool config YAML.
        tool_schema: its schema (an :class:`OpenAIFunctionToolSchema` or a dict); None asks
            ``get_openai_tool_schema``.
    """

    def __init__(self, config: dict | None, tool_schema: OpenAIFunctionToolSchema | dict | None):
        self.config = dict(config or {})
        if isinstance(tool_schema, dict):
            tool_schema = OpenAIFunctionToolSchema.from_dict(tool_schema, f"{type(self).__name__} tool_schema")
        self.tool_schema = tool_schema if tool_schema is not None else self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(f"{type(self).__name__} has no tool schema")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """Start a trajectory's instance; returns its id (and an optional first response)."""
        return instance_id or str(uuid.uuid4()), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[Any, float, dict]:
        """Run one call: ``(response, step_reward, metrics)``; every tool defines it."""
        raise NotImplementedError(f"{type(self).__name__} does not define execute")

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The instance's reward when its trajectory ends."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the instance."""
