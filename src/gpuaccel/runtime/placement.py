"""Where and how a run computes, decided once for ``Trainer`` and ``Accelerator`` alike: the
process group (under torchrun), the device, the precision, the memory layout of a model with
convolutions, and the settings of CUDA's libraries."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..device import Precision, has_tf32, resolve_device, resolve_precision
from ..parallel import Distributed


@dataclass(frozen=True)
class Placement:
    dist: Distributed
    device: torch.device
    precision: Precision

    @classmethod
    def resolve(cls, device="auto", precision="auto") -> "Placement":
        """``device``: auto (a CUDA GPU if there is one), cpu, cuda or cuda:N; under torchrun each
        process takes GPU LOCAL_RANK and joins the process group. ``precision``: auto (bf16 on
        GPUs that have it, fp16 with loss scaling on older ones, fp32 on the CPU) or any spelling
        of fp32, tf32, bf16, fp16 (``'bfloat16'``, ``torch.bfloat16``, ``'16-mixed'``, ...)."""
        dist = Distributed.from_env()
        chosen = dist.device(str(device)) if dist.active else resolve_device(str(device))
        dist.init(chosen)
        resolved = resolve_precision(precision, chosen)
        resolved.configure()
        if chosen.type == "cuda":
            torch.cuda.set_device(chosen)
            torch.zeros((), device=chosen)  # CUDA's context now, so that its cost is charged here
        return cls(dist, chosen, resolved)

    def fitted_to(self, model: nn.Module) -> "Placement":
        """This placement, or for a model with recurrent layers (nn.LSTM, nn.GRU, nn.RNN) under an
        autocast precision, one without autocast: under it cuDNN's recurrent kernels get cast
        weights that are no longer one contiguous buffer and repack them every step, which made a
        recurrent model slower in bf16 than in fp32. It is tf32 where the GPU has it (fp32 tensors; the other layers'
        matrix multiplies on the tensor cores, as cuDNN runs the recurrent ones by default; cuBLAS's
        TF32 is turned on here), else fp32."""
        if self.precision.autocast_dtype is None or not any(isinstance(m, nn.RNNBase) for m in model.modules()):
            return self
        precision = resolve_precision("tf32" if has_tf32(self.device) else "fp32", self.device)
        precision.configure()
        return dataclasses.replace(self, precision=precision)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def channels_last(self, model: nn.Module, requested: bool | None = None) -> bool:
        """Whether ``model`` and its image batches are laid out channels-last (NHWC): by default on
        a GPU for a model with 2-D convolutions, whose cuDNN kernels run on NHWC tensors (an NCHW
        input is converted at every layer)."""
        if requested is not None:
            return requested
        return self.on_gpu and any(isinstance(m, nn.Conv2d) for m in model.modules())

    def configure_kernels(self, *, deterministic: bool = False, cudnn_benchmark: bool = True) -> None:
        """Deterministic kernels (cuDNN's autotuner times its candidates, so which kernel wins, and
        its rounding, varies from process to process; cuBLAS needs a fixed workspace before its
        first call), or cuDNN's autotuner for fixed shapes (each shape is timed once)."""
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        elif self.on_gpu:
            torch.backends.cudnn.benchmark = cudnn_benchmark


class ScaledOptimizer(torch.optim.Optimizer):
    """The user's optimizer under fp16: ``step`` goes through the loss scaler (it skips a step
    whose gradients overflowed and adjusts the scale). Everything else is the optimizer's own,
    and schedulers take it as the optimizer it wraps."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler):
        # (not Optimizer.__init__: the groups, state and defaults are the wrapped optimizer's)
        self.optimizer, self.scaler = optimizer, scaler
        self._unscaled = False

    def unscale(self) -> None:
        """Divides the gradients by the loss scale, once per step (for clipping)."""
        if not self._unscaled:
            self.scaler.unscale_(self.optimizer)
            self._unscaled = True

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def step(self, closure=None):
        self._unscaled = False
        result = self.scaler.step(self.optimizer)
        self.scaler.update()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name):
        return getattr(self.__dict__["optimizer"], name)
