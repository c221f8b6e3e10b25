"""Interactions that answer the model between turns (verl's ``verl.interactions`` at ``posttrain.interactions``)."""

from posttrain.interactions.base import BaseInteraction
from posttrain.interactions.registry import load_interaction_config

__all__ = ["BaseInteraction", "load_interaction_config"]
