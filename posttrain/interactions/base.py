"""The interaction interface (verl's ``BaseInteraction``): a simulated user or environment that
answers the model after each of its turns (when the model called no tool).

For a trajectory whose row has ``extra_info.interaction_kwargs = {name, ...}`` the agent loop calls::

    instance_id = await interaction.start_interaction(None, **interaction_kwargs)
    done, text, reward, meta = await interaction.generate_response(instance_id, messages)   # after a turn
    score = await interaction.calculate_score(instance_id)                                 # at the end
    await interaction.finalize_interaction(instance_id)

``messages`` is the conversation so far as ``[{"role", "content"}]`` (the prompt's messages when the
row has them, then the decoded turns). ``text`` becomes a user turn; ``done`` ends the trajectory.
"""

from __future__ import annotations

import uuid
from typing import Any

__all__ = ["BaseInteraction"]


class BaseInteraction:
    """Args: config: the interaction's ``config`` mapping (``name`` is set from the YAML entry)."""

    def __init__(self, config: dict | None):
        self.config = dict(config or {})
        self.name: str = self.config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        return instance_id or str(uuid.uuid4())

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> tuple[bool, str, float, dict]:
        """``(should_terminate, response_text, turn_score, metadata)``; the base interaction ends the
        conversation after the model's first turn."""
        return True, "", 0.0, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        pass
