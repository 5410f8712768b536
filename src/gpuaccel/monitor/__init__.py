"""Watching a run: GPU telemetry, where step time goes, traces and TensorBoard scalars."""

from .gpu import GpuSampler
from .steps import DataWaitMeter

__all__ = ["DataWaitMeter", "GpuSampler"]
