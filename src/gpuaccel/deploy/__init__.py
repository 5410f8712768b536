"""Deployment: export trained models, verify the exports, and run inference with any of them."""

from .artifact import Normalized, TrainedModel, load_trained
from .export import FORMATS, export, verify
from .runners import Runner, load_runner

__all__ = ["FORMATS", "Normalized", "Runner", "TrainedModel", "export", "load_runner", "load_trained", "verify"]
