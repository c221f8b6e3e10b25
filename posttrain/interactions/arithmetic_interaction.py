"""The built-in arithmetic task's "try again" interaction: after each assistant turn the last
answer (``#### N``, strict) is checked against the ground truth; right ends the trajectory, wrong
asks for another attempt. The score is the last checked answer's (1 or 0)."""

from __future__ import annotations

import uuid
from typing import Any

from posttrain.interactions.base import BaseInteraction
from posttrain.rewards import arithmetic

__all__ = ["ArithmeticInteraction", "RIGHT", "WRONG"]

RIGHT = "Correct."
WRONG = "That is not right. Work it out again and end with #### and the answer."


class ArithmeticInteraction(BaseInteraction):
    def __init__(self, config: dict | None):
        super().__init__(config)
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: str | None = None,
                                **kwargs: Any) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        self._instances[instance_id] = {"ground_truth": ground_truth, "score": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any):
        state = self._instances[instance_id]
        answer = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        state["score"] = 0.0 if state["ground_truth"] is None else arithmetic.compute_score(answer, state["ground_truth"])
        return (True, RIGHT, state["score"], {}) if state["score"] == 1.0 else (False, WRONG, state["score"], {})

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return self._instances[instance_id]["score"]

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
