"""Smaller ONNX models with ONNX Runtime's tools: post-training static int8 quantisation
calibrated on real images, and fp16 conversion for GPU runtimes.

int8: the fp32 ONNX model is pre-processed (shape inference, graph optimisation), then
weights and activations are quantised (QDQ format: uint8 activations, int8 weights, per
tensor or per output channel), with activation ranges from calibration batches of
training images. fp16: weights and computation in half precision, inputs and outputs
kept float32 (casts at the edges), so the artefact is used exactly like the fp32 one.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from ..errors import GpuaccelError


def quantize_int8(fp32_model: Path, out: Path, calibration: np.ndarray, *, per_channel: bool = False,
                  batch_size: int = 32) -> Path:
    """``calibration``: uint8 images (N, C, H, W) from the training data."""
    if calibration is None or len(calibration) == 0:
        raise GpuaccelError("int8 quantisation needs calibration images and none are available; "
                            "pass --data SPEC with the training data")
    try:
        from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType, quantize_static)
        from onnxruntime.quantization.shape_inference import quant_pre_process
    except ImportError:
        raise GpuaccelError("int8 quantisation needs onnxruntime: pip install 'gpuaccel[deploy]'") from None
    import onnxruntime as ort

    input_name = ort.InferenceSession(str(fp32_model), providers=["CPUExecutionProvider"]).get_inputs()[0].name

    class Batches(CalibrationDataReader):
        def __init__(self):
            self.starts = iter(range(0, len(calibration), batch_size))

        def get_next(self):
            start = next(self.starts, None)
            if start is None:
                return None
            return {input_name: calibration[start:start + batch_size].astype(np.float32) / 255.0}

    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        quant_pre_process(str(fp32_model), str(prepared), skip_symbolic_shape=True)
        quantize_static(str(prepared), str(out), Batches(), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return Path(out)


def convert_fp16(fp32_model: Path, out: Path) -> Path:
    try:
        import onnx
        from onnxruntime.transformers.float16 import convert_float_to_float16
    except ImportError:
        raise GpuaccelError("fp16 conversion needs onnx and onnxruntime: pip install 'gpuaccel[deploy]'") from None
    half = convert_float_to_float16(onnx.load(str(fp32_model)), keep_io_types=True)
    onnx.save(half, str(out))
    return Path(out)


def calibration_sample(train_images: np.ndarray, count: int) -> np.ndarray:
    """``count`` training images spread over the whole set (a fixed random choice, in order)."""
    picks = np.random.default_rng(0).permutation(len(train_images))[:count]
    return train_images[np.sort(picks)]


def compare(models: dict, test_images: np.ndarray, test_labels: np.ndarray, device: str = "cpu",
            runtime: str = "onnxruntime") -> dict:
    """Size, held-out accuracy and speed in ``runtime`` on ``device`` of each ONNX file in
    ``models`` (name -> path)."""
    from ..bench.timing import measure
    from .infer import predict, top1_accuracy
    from .runners import load_runner

    report = {}
    for name, path in models.items():
        runner = load_runner(path, device, runtime=runtime)
        probs, _ = predict(runner, test_images)
        c, s = runner.in_channels, runner.image_size
        speed = measure(runner, lambda b: np.random.rand(b, c, s, s).astype(np.float32), repeats=100)
        report[name] = {"size_bytes": Path(path).stat().st_size,
                        "test_accuracy": top1_accuracy(probs, test_labels),
                        "latency_p50_ms": speed["latency_p50_ms"],
                        "best_images_per_second": speed["best_images_per_second"]}
    return report


def evaluation_device(kind: str, asked: str | None, runtime: str = "onnxruntime") -> str:
    """Where ``quantize`` evaluates and times its artefacts: what was asked for, else the GPU for
    fp16 when ONNX Runtime can use one here (fp16 is for GPUs), else the CPU."""
    import torch

    from .runners import onnx_has_cuda

    if asked:
        return asked
    gpu = runtime == "onnxruntime" and torch.cuda.is_available() and onnx_has_cuda()
    return "cuda" if kind == "fp16" and gpu else "cpu"
