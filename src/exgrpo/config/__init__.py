"""The run configuration: the schema (sections with field docs), its rules, and loading from YAML + overrides."""

from exgrpo.config.load import config_from_dict, load_config, parse_overrides, read_run_config, read_yaml
from exgrpo.config.presets import config_file, preset_names
from exgrpo.config.changes import RESUMABLE_CHANGES, config_changes
from exgrpo.config.rules import compute_precision, engine_correction_cap, engine_precision, validate
from exgrpo.config.schema import (DataConfig, EvalConfig, ExGRPOConfig, ExperienceConfig, GuidanceConfig,
                                  LoggingConfig, LoraConfig, ModelConfig, ObjectiveConfig, RewardConfig,
                                  RolloutConfig, TrainConfig)
from exgrpo.errors import ConfigError

__all__ = ["ConfigError", "DataConfig", "EvalConfig", "ExGRPOConfig", "ExperienceConfig", "GuidanceConfig",
           "LoggingConfig", "LoraConfig", "ModelConfig", "ObjectiveConfig", "RESUMABLE_CHANGES", "RewardConfig",
           "RolloutConfig", "TrainConfig", "compute_precision", "config_changes", "config_file", "config_from_dict",
           "engine_correction_cap", "engine_precision", "load_config", "parse_overrides", "preset_names",
           "read_run_config", "read_yaml", "validate"]
