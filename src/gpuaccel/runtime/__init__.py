"""The one runtime under both doors: ``Trainer`` (a loop gpuaccel writes) and ``Accelerator``
(a loop the user keeps) place, wrap, capture and feed a model through the same pieces.

- :mod:`.placement`: the process group, the device, the precision, the memory layout and the
  settings of CUDA's libraries; under fp16, the optimizer stepped through the loss scaler.
- :mod:`.strategy`: which parallel strategy (``gpuaccel.parallel``) a process trains with.
- :mod:`.capture`: a whole training step as CUDA graphs (:class:`CapturedStep`), and the
  optimizers' capturable (fused) updates.
- :mod:`.loaders`: the two engines of every loader: the data set resident on the device
  (:class:`ResidentLoader`), or host batches prefetched onto it (:class:`PrefetchLoader`); where
  data lives (:func:`resident_bytes`), decided once for every loader.
"""

from .capture import CapturedStep, make_capturable
from .loaders import (HostPasses, PrefetchLoader, ResidentLoader, dataset_loader, image_loader, prepare_loader,
                      resident_bytes, user_loader)
from .placement import Placement
from .strategy import STRATEGIES, choose_strategy, holds_whole_model, training_strategy

__all__ = ["CapturedStep", "HostPasses", "Placement", "PrefetchLoader", "ResidentLoader", "STRATEGIES",
           "choose_strategy", "dataset_loader", "image_loader", "make_capturable", "prepare_loader", "resident_bytes",
           "holds_whole_model", "training_strategy", "user_loader"]
