"""posttrain's config: verl's key tree as typed dataclasses, loading, validation, derived sizes."""

from posttrain.config.derived import DerivedSizes, derive_sizes, describe_sizes, uses_critic, uses_reference, worker_config
from posttrain.config.load import ConfigError, load_config, load_raw, parse_value, split_override, to_yaml
from posttrain.config.schema import PostTrainConfig
from posttrain.config.validate import find_problems, validate_config

__all__ = [
    "ConfigError",
    "DerivedSizes",
    "PostTrainConfig",
    "derive_sizes",
    "describe_sizes",
    "find_problems",
    "load_config",
    "load_raw",
    "parse_value",
    "split_override",
    "to_yaml",
    "uses_critic",
    "uses_reference",
    "validate_config",
    "worker_config",
]
