"""One interface over every form a model can take: ``runner(images) -> logits``.

``images`` are float32 arrays (N, C, H, W) in [0, 1]; logits come back as float32 numpy.
A gpuaccel checkpoint runs in PyTorch; ``.onnx`` in ONNX Runtime; ``.pt2`` through
torch.export; ``.ts`` / ``.torchscript`` through TorchScript.
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


def _onnx_runner(path: Path, device: torch.device, threads: int | None = None):
    try:
        import onnxruntime as ort
    except ImportError:
        raise GpuaccelError("running .onnx files needs onnxruntime: pip install 'gpuaccel[deploy]'") from None
    providers = ["CPUExecutionProvider"]
    if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    try:
        session = ort.InferenceSession(str(path), options, providers=providers)
    except Exception as exc:  # onnxruntime raises its own exception classes for bad files
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise GpuaccelError(f"{path} is not a valid ONNX model ({first})") from None
    name = session.get_inputs()[0].name
    return lambda images: session.run(None, {name: images})[0]
