"""posttrain's config: verl's key tree as typed dataclasses, loading, validation, derived sizes."""

from pathlib import Path as _Path

from posttrain.config.derived import DerivedSizes, derive_sizes, describe_sizes, uses_critic, uses_reference, worker_config
from posttrain.config.load import ConfigError, load_config, load_raw, parse_value, split_override, to_yaml
from posttrain.config.schema import PostTrainConfig
from posttrain.config.validate import find_problems, validate_config

BUILTIN_CONFIG = _Path(__file__).parent / "builtin.yaml"
"""The built-in default run (`posttrain train` with no --config)."""

__all__ = [
    "BUILTIN_CONFIG",
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
