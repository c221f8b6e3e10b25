"""Interactions from verl's interaction config YAML (``interaction: [{name, class_name, config}]``)."""

from __future__ import annotations

from posttrain.errors import ConfigError
from posttrain.interactions.base import BaseInteraction
from posttrain.tools.registry import checked_class, read_yaml_list

__all__ = ["load_interaction_config", "INTERACTION_METHODS"]

# The documented interaction protocol (``posttrain.interactions.base``) for a class that does not subclass
# BaseInteraction: the agent loop calls each of these.
INTERACTION_METHODS = ("start_interaction", "generate_response", "calculate_score", "finalize_interaction")


def load_interaction_config(path: str) -> dict[str, BaseInteraction]:
    """``{name: interaction}`` built from the file; ConfigError naming the entry on a bad class or name."""
    out: dict[str, BaseInteraction] = {}
    for i, entry in enumerate(read_yaml_list(path, "interaction")):
        where = f"{path} interaction[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ConfigError(f"{where}: each interaction needs class_name (and name, config)")
        cls = checked_class(entry["class_name"], where, BaseInteraction, INTERACTION_METHODS, "an interaction")
        name = entry.get("name") or cls.__name__.removesuffix("Interaction").lower() or cls.__name__
        if name in out:
            raise ConfigError(f"{where}: two interactions are named {name!r}; names must be unique")
        try:
            inst = cls({**(entry.get("config") or {}), "name": name})
        except Exception as err:
            raise ConfigError(f"{where}: {entry['class_name']}(config) failed: {type(err).__name__}: {err}") from None
        out[name] = inst
    return out
