"""Typed run config: schema, loading with overrides and variables, validation, derived numbers."""

from foundryx.config.derived import Derived, derive
from foundryx.config.load import LoadedConfig, load_config
from foundryx.config.schema import TrainConfig

__all__ = ["Derived", "LoadedConfig", "TrainConfig", "derive", "load_config"]
