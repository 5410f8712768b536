"""gpuaccel: fast deep-learning training and inference on NVIDIA GPUs, the same code on a CPU.

Importing the package changes nothing in the importing process (no environment variables, no
interpreter settings); its parts are imported when first used (``gpuaccel.Trainer``, ...).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# what the package offers, and the module each comes from (imported on first use)
_EXPORTS = {
    "Accelerator": ".accelerator", "capture": ".accelerator", "BatchSource": ".data.source",
    "GpuaccelError": ".errors", "ImageDataset": ".data", "StreamingDataset": ".data",
    "load_dataset": ".data", "open_dataset": ".data", "create_model": ".models", "list_models": ".models",
    "register_model": ".models", "TrainConfig": ".train", "Trainer": ".train",
}
__all__ = sorted([*_EXPORTS, "tasks", "__version__"])


def __getattr__(name: str):
    if name == "tasks":
        return importlib.import_module(".tasks", __name__)
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value  # (once: later reads find it directly)
        return value
    raise AttributeError(f"module 'gpuaccel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
