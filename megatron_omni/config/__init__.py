"""Run configuration: typed dataclasses (schema), named recipes, and the YAML/override loader."""
from .loader import config_to_yaml, load_config
from .recipes import get_recipe, recipe_names, register_recipe
from .schema import ConfigError, LoggingConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig

__all__ = [
    "ConfigError", "LoggingConfig", "ModelConfig", "ParallelConfig", "RunConfig", "TrainConfig",
    "config_to_yaml", "get_recipe", "load_config", "recipe_names", "register_recipe",
]
