"""One interface over every form a model can take: ``runner(images) -> logits``.

``images`` are float32 arrays (N, C, H, W) in [0, 1]; logits come back as float32 numpy.
A gpuaccel checkpoint runs in PyTorch; ``.onnx`` in ONNX Runtime; ``.pt2`` through
torch.export; ``.ts`` / ``.torchscript`` through TorchScript. On a GPU, ``.onnx`` needs
onnxruntime-gpu, which uses the CUDA and cuDNN libraries PyTorch has already loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import GpuaccelError

FORMAT_SUFFIX = {"onnx": ".onnx", "pt2": ".pt2", "torchscript": ".ts"}


@dataclass
class Runner:
    run: Callable[[np.ndarray], np.ndarray]
    classes: list[str]
    in_channels: int
    image_size: int
    kind: str

    def __call__(self, images: np.ndarray) -> np.ndarray:
        return self.run(np.ascontiguousarray(images, dtype=np.float32))


def metadata_path(artifact: Path) -> Path:
    return artifact.with_name(artifact.name + ".json")


def torch_runner(module, device: torch.device, set_eval: bool = True):
    """``run(images) -> logits`` for a PyTorch module on ``device`` (numpy in, numpy out)."""
    module = module.to(device)
    if set_eval:  # an exported program is already in inference form and refuses .eval()
        module.eval()

    @torch.no_grad()
    def run(images):
        return module(torch.from_numpy(images).to(device)).float().cpu().numpy()
    return run


def load_runner(path, device: str = "cpu", threads: int | None = None) -> Runner:
    """``threads``: CPU threads of ONNX Runtime's intra-op pool (default: its own choice, every
    core); PyTorch's CPU threads are set with ``torch.set_num_threads``."""
    path = Path(path)
    if not path.exists():
        raise GpuaccelError(f"model file {path} does not exist")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GpuaccelError(f"--device {device} was asked for but no CUDA GPU is visible; use --device cpu")
    if path.is_dir() or path.suffix == ".pt":
        from .artifact import load_trained

        trained = load_trained(path)
        return Runner(torch_runner(trained.module, dev), trained.classes, trained.in_channels,
                      trained.image_size, "pytorch")
    meta_file = metadata_path(path)
    if not meta_file.exists():
        raise GpuaccelError(f"{path} has no {meta_file.name} beside it (class names, input size); "
                            f"export models with 'gpuaccel export'")
    meta = json.loads(meta_file.read_text())
    if path.suffix == ".onnx":
        run = _onnx_runner(path, dev, threads)
        kind = "onnxruntime"
    elif path.suffix == ".pt2":
        try:
            program = torch.export.load(str(path))
        except Exception as exc:  # torch raises several types for a damaged archive
            raise GpuaccelError(f"{path} is not a readable torch.export (.pt2) file ({type(exc).__name__})") from None
        run, kind = torch_runner(program.module(), dev, set_eval=False), "torch.export"
    elif path.suffix in (".ts", ".torchscript"):
        try:
            module = torch.jit.load(str(path), map_location=dev)
        except Exception as exc:
            raise GpuaccelError(f"{path} is not a readable TorchScript file ({type(exc).__name__})") from None
        run, kind = torch_runner(module, dev), "torchscript"
    else:
        raise GpuaccelError(f"cannot run {path}: expected a gpuaccel checkpoint (.pt), .onnx, .pt2 or .ts")
    return Runner(run, meta["classes"], meta["in_channels"], meta["image_size"], kind)


def onnx_has_cuda() -> bool:
    """Whether the installed ONNX Runtime can run on NVIDIA GPUs (the onnxruntime-gpu build)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers()


def cuda_provider(device: torch.device, cuda_graph: bool = False) -> tuple[str, dict]:
    """onnxruntime-gpu's CUDA provider with its options for ``device``.

    prefer_nhwc: channels-last convolutions, 1.3-1.4x the throughput on an H200
    (benchmarks/onnx_gpu_options.py). The ordinal is torch's, so "cuda" means the same GPU for
    every kind of model; device_id 0 is the provider's default and is left out, as onnxruntime
    1.31 logs a warning about plugin devices whenever it is given. cuda_graph: the session
    captures its first run as a CUDA graph and replays it, which needs inputs and outputs bound
    to fixed GPU memory (one session per input shape).
    """
    options = {"prefer_nhwc": "1"}
    if cuda_graph:
        options["enable_cuda_graph"] = "1"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index:
        options["device_id"] = str(index)
    return "CUDAExecutionProvider", options


def _onnx_runner(path: Path, device: torch.device, threads: int | None = None):
    try:
        import onnxruntime as ort
    except ImportError:
        raise GpuaccelError("running .onnx files needs onnxruntime: pip install 'gpuaccel[deploy]'") from None
    providers = ["CPUExecutionProvider"]
    if device.type == "cuda":
        if not onnx_has_cuda():
            raise GpuaccelError(f"running {path.name} on {device} needs onnxruntime-gpu (the installed onnxruntime "
                                f"has only its CPU provider): pip install 'gpuaccel[deploy-gpu]', or use --device cpu")
        providers.insert(0, cuda_provider(device))
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    try:
        session = ort.InferenceSession(str(path), options, providers=providers)
    except Exception as exc:  # onnxruntime raises its own exception classes for bad files
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise GpuaccelError(f"{path} is not a valid ONNX model ({first})") from None
    if device.type == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        # onnxruntime falls back to the CPU when its CUDA libraries fail to load, and only logs it
        raise GpuaccelError(f"onnxruntime-gpu could not start its CUDA provider for {path.name} (its log above "
                            f"says why; usually CUDA or cuDNN libraries it cannot find); use --device cpu")
    name = session.get_inputs()[0].name
    return lambda images: session.run(None, {name: images})[0]
