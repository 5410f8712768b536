"""gpuaccel: fast deep-learning training and inference on NVIDIA GPUs, the same code on a CPU."""

__version__ = "0.1.0"

from .caches import use_bytecode_cache, use_compile_cache  # noqa: E402  (first: before anything imports torch)

use_bytecode_cache()
use_compile_cache()

from . import tasks  # noqa: E402  (gpuaccel.tasks: Classification, Regression, CustomTask, ...)
from .accelerator import Accelerator  # noqa: E402
from .data import ImageDataset, StreamingDataset, load_dataset, open_dataset  # noqa: E402
from .errors import GpuaccelError  # noqa: E402
from .models import create_model, list_models, register_model  # noqa: E402
from .train import TrainConfig, Trainer  # noqa: E402

__all__ = ["Accelerator", "GpuaccelError", "ImageDataset", "StreamingDataset", "TrainConfig", "Trainer", "create_model",
           "list_models", "load_dataset", "open_dataset", "register_model", "tasks", "__version__"]
