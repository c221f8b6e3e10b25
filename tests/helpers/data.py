"""The real ``data`` config section with overrides, for tests that do not load the whole config."""

from __future__ import annotations

import dataclasses
from typing import Any

from posttrain.config.schema import DataConfig


def make_data_config(**overrides: Any) -> DataConfig:
    """``DataConfig`` (verl 0.9's defaults, exactly those of ``load_config().data``) with ``overrides``."""
    known = {f.name for f in dataclasses.fields(DataConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise TypeError(f"unknown data config key(s) {sorted(unknown)}")
    return DataConfig(**overrides)
