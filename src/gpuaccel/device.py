"""Choosing the device and the numeric precision, automatically or as forced."""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import torch

from .errors import GpuaccelError, choice_error

PRECISIONS = ("auto", "fp32", "tf32", "bf16", "fp16")


def resolve_device(spec: str = "auto") -> torch.device:
    """'auto' picks the first CUDA GPU when there is one, else the CPU."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise GpuaccelError(
                f"--device {spec} was asked for but no CUDA GPU is visible to PyTorch "
                f"(torch {torch.__version__}); use --device cpu or --device auto")
        index = 0
        if ":" in spec:
            tail = spec.split(":", 1)[1]
            if not tail.isdigit():
                raise GpuaccelError(f"bad device {spec!r}; write cuda:N with N a GPU index")
            index = int(tail)
        count = torch.cuda.device_count()
        if index >= count:
            raise GpuaccelError(f"--device {spec}: only {count} GPU(s) present (indices 0..{count - 1})")
        return torch.device("cuda", index)
    raise choice_error("device", spec, ["auto", "cpu", "cuda", "cuda:N"])


_REGION = threading.local()


@contextlib.contextmanager
def capturable_region():
    """Marks the calls of a step that is captured as a CUDA graph (``runtime.capture.CapturedStep``
    enters it for every call it may record): :meth:`Precision.autocast` keeps no cache there."""
    _REGION.capturable = getattr(_REGION, "capturable", 0) + 1
    try:
        yield
    finally:
        _REGION.capturable -= 1


@dataclass(frozen=True)
class Precision:
    """How the forward and backward passes run: a name, the autocast dtype, loss scaling, and
    whether fp32 matrix multiplies run on the tensor cores in TF32 (fp32's range, a 10-bit
    mantissa; cuDNN's convolutions and recurrent layers already do by default)."""

    name: str
    autocast_dtype: torch.dtype | None
    loss_scaling: bool
    tf32_matmul: bool = False

    def configure(self) -> None:
        """Sets what the precision needs of the process: TF32 matrix multiplies for 'tf32' (a
        process-wide cuBLAS setting, so it stays on; the other precisions leave it as it is)."""
        if self.tf32_matmul:
            torch.backends.cuda.matmul.allow_tf32 = True

    def autocast(self, device: torch.device):
        """The autocast context for this precision (none for fp32 and tf32): the one autocast
        policy of both doors. Its cache of cast weights is off inside a step that is captured as
        a CUDA graph (every call of it: warm-up, recording and replay, see
        :func:`capturable_region`) and while any CUDA graph is recorded, on elsewhere. A cast
        cached during a recording would be memory of the graph's private pool (PyTorch asks for
        ``cache_enabled=False`` under capture), and the warm-up must see the same setting as the
        recording: torch.compile's guards include it, and a change would compile the model again
        inside the recording."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        captured = getattr(_REGION, "capturable", 0) > 0 or \
            (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype, cache_enabled=not captured)

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype batches are normalised into: the autocast dtype on GPUs saves a cast."""
        return self.autocast_dtype or torch.float32


# other spellings of each precision: PyTorch's dtypes and names, HF Accelerate's and Lightning's
_SPELLINGS = {
    "fp32": ("float32", "float", "32", "32-true", "no", "full"),
    "tf32": ("tensorfloat32", "tensorfloat-32"),
    "bf16": ("bfloat16", "bf16-mixed", "bf16-true"),
    "fp16": ("float16", "half", "16", "16-mixed", "fp16-mixed"),
}
_CANONICAL = {alias: name for name, aliases in _SPELLINGS.items() for alias in aliases + (name,)}
_CANONICAL["auto"] = "auto"


def precision_name(spec) -> str:
    """'auto', 'fp32', 'tf32', 'bf16' or 'fp16' for any spelling of one: a name ('bfloat16', 'half',
    'bf16-mixed', ...) or a torch dtype (torch.bfloat16)."""
    if spec is None:
        return "auto"
    if isinstance(spec, torch.dtype):
        spec = str(spec).removeprefix("torch.")
    name = _CANONICAL.get(str(spec).strip().lower())
    if name is None:
        raise choice_error("precision", spec, PRECISIONS + ("or a torch dtype",))
    return name


def has_tf32(device: torch.device) -> bool:
    """Whether ``device`` has tensor cores that take TF32 (NVIDIA compute capability 8.0, Ampere, on)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def resolve_precision(spec, device: torch.device) -> Precision:
    """auto: bf16 autocast on GPUs that support it, fp16 with loss scaling on older GPUs,
    fp32 on the CPU. tf32: fp32 whose matrix multiplies run in TF32 (GPUs of compute
    capability 8.0 on). ``spec``: any spelling :func:`precision_name` reads."""
    spec = precision_name(spec)
    if spec == "auto":
        if device.type == "cuda":
            spec = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            spec = "fp32"
    if spec == "fp32":
        return Precision("fp32", None, False)
    if spec == "tf32":
        if not has_tf32(device):
            where = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
            raise GpuaccelError(f"--precision tf32 needs an NVIDIA GPU of compute capability 8.0 or later, not "
                                f"{where}; use fp32")
        return Precision("tf32", None, False, tf32_matmul=True)
    if spec == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise GpuaccelError(f"{torch.cuda.get_device_name(device)} has no bf16 support; use --precision fp16")
        return Precision("bf16", torch.bfloat16, False)
    if device.type != "cuda":
        raise GpuaccelError("--precision fp16 needs a CUDA GPU; on the CPU use fp32 or bf16")
    return Precision("fp16", torch.float16, True)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def cpu_name() -> str:
    """The CPU's model name as the kernel reports it."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def new_host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied to new host memory (or itself where it is there already): how a state
    goes to the host unless a caller copies otherwise (``PinnedCopies``)."""
    return tensor.detach().cpu()


def host_memory_bytes() -> int | None:
    """The host's physical memory, where the system says (None elsewhere)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class PinnedCopies:
    """Host copies of GPU tensors in page-locked buffers made at the first copy and refilled at
    each one after: ``copies(tensor)`` starts a copy and returns its buffer, ``finish()`` waits
    for them all. Each source tensor (its memory, shape and type) has one buffer, so tensors
    that share memory share a buffer, and a buffer whose source was not copied since the last
    ``finish`` is let go.

    Why: a copy to new pageable memory (``tensor.cpu()``) moved GPT-2 small's 400 MB in 0.25 s
    on an H200's host, into page-locked memory in 0.008 s; allocating that memory took 0.20 s
    the first time (benchmarks/cold_start/results/host_copies_h200.json). Worth it for copies
    repeated through a run (the best weights at each better evaluation); each buffer holds its
    memory until the object goes."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._copied: dict[tuple, torch.Tensor] = {}

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        buffer = self._copied.get(key)
        if buffer is None:
            buffer = self._buffers.get(key)
            if buffer is None:
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            buffer.copy_(tensor.detach(), non_blocking=True)
            self._copied[key] = buffer
        return buffer

    def finish(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()
        self._buffers, self._copied = self._copied, {}
