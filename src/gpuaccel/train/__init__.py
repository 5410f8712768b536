"""Training: the config, the engine, optimizers and schedules, checkpoints."""

from .config import (DataSettings, LoggingSettings, LoopSettings, ModelSettings, OptimizerSettings, ParallelSettings,
                     RuntimeSettings, TrainConfig)
from .trainer import Trainer

__all__ = ["TrainConfig", "Trainer", "DataSettings", "ModelSettings", "RuntimeSettings", "ParallelSettings",
           "OptimizerSettings", "LoopSettings", "LoggingSettings"]
