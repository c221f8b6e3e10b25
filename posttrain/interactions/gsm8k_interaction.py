"""verl's GSM8K "try again" interaction: after each assistant turn, the last assistant message is
scored against the ground truth (flexible GSM8K rule); right ends the trajectory, wrong asks the
model to reflect and answer again."""

from __future__ import annotations

import uuid
from typing import Any

from posttrain.interactions.base import BaseInteraction
from posttrain.rewards import gsm8k

__all__ = ["Gsm8kInteraction"]

CORRECT = "Your answer is correct."
INCORRECT = "Your answer is not correct. Check your work and try again."


class Gsm8kInteraction(BaseInteraction):
    def __init__(self, config: dict | None):
        super().__init__(config)
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: str | None = None,
                                **kwargs: Any) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any):
        content = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        self._instances[instance_id]["response"] = content if content.startswith("#### ") else "#### " + content
        score = await self.calculate_score(instance_id)
        return (True, CORRECT, score, {}) if score == 1.0 else (False, INCORRECT, score, {})

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instances[instance_id]
        if state["ground_truth"] is None:
            return 0.0
        return gsm8k.compute_score(state["response"], str(state["ground_truth"]), method="flexible",
                                   format_score=0.0, score=1.0)

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
