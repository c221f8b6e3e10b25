"""verl's GSM8K demo tool: the model submits an answer and reads whether it is right.

Each call scores ``"#### " + answer`` against the row's ground truth (``create_kwargs.ground_truth``)
with the flexible GSM8K rule; the step reward is -0.05 when the score did not improve on the
previous call's (a penalty for resubmitting), and ``calc_reward`` is the last call's score.
"""

from __future__ import annotations

import uuid
from typing import Any

from posttrain.rewards import gsm8k
from posttrain.tools.base_tool import BaseTool
from posttrain.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["Gsm8kTool"]

NO_IMPROVEMENT_PENALTY = -0.05


class Gsm8kTool(BaseTool):
    """``calc_gsm8k_reward(answer: str)``; schema from the tool config YAML (verl's file works)."""

    def __init__(self, config: dict | None, tool_schema: OpenAIFunctionToolSchema | dict | None):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs: Any):
        instance_id = instance_id or str(uuid.uuid4())
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        answer = parameters.get("answer", "") if isinstance(parameters, dict) else ""
        answer = answer if isinstance(answer, str) else str(answer)
        state = self._instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else NO_IMPROVEMENT_PENALTY
        state["reward"] = reward
        return ToolResponse(f"Parsed answer: {answer}; reward: {reward}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instances[instance_id]
        if state["ground_truth"] is None:
            return 0.0
        return gsm8k.compute_score(state["response"], str(state["ground_truth"]), method="flexible",
                                   format_score=0.0, score=1.0)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
