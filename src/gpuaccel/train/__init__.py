"""Training: the config, the engine, optimizers and schedules, checkpoints."""

from .config import TrainConfig
from .trainer import Trainer

__all__ = ["TrainConfig", "Trainer"]
