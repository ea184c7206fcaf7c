"""The ``"adabatch"`` section of a ds_config: models, loading, and one error type for every problem."""

from .errors import ConfigError, ConfigProblem
from .loader import BATCH_KEYS, LoadedConfig, load_adabatch_section, load_ds_config
from .models import AdaBatchConfig, DataConfig, LogConfig, LrScalingConfig
from .schedules import ScheduleConfig

__all__ = [
    "BATCH_KEYS",
    "AdaBatchConfig",
    "ConfigError",
    "ConfigProblem",
    "DataConfig",
    "LoadedConfig",
    "LogConfig",
    "LrScalingConfig",
    "ScheduleConfig",
    "load_adabatch_section",
    "load_ds_config",
]
