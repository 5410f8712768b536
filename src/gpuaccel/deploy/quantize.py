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


def quantize_model(source, kind: str, *, calibration_images: int = 512, per_channel: bool = False,
                   data: str | None = None, out=None, device: str | None = None,
                   runtime: str = "onnxruntime") -> dict:
    """Quantises a trained model (a run, or an .onnx that 'gpuaccel export' made) to ``kind``
    ('int8': ONNX Runtime's static quantisation calibrated on ``calibration_images`` training
    images; 'fp16': for GPU runtimes), writes the artefact and its .json beside it, and compares
    both versions' size, held-out accuracy and speed in ``runtime`` (:func:`compare`)."""
    import json

    from .artifact import load_trained
    from .export import export
    from .runners import check_runtime, load_runner, metadata_path

    check_runtime(runtime)
    source = Path(source)
    with tempfile.TemporaryDirectory() as tmp:
        if source.suffix == ".onnx":
            if not source.exists():
                raise GpuaccelError(f"model file {source} does not exist")
            meta = json.loads(metadata_path(source).read_text()) if metadata_path(source).exists() else {}
            if "source" not in meta:
                raise GpuaccelError(f"{source} has no {metadata_path(source).name} naming its checkpoint; "
                                    f"export it with 'gpuaccel export'")
            load_runner(source)  # a corrupt file fails here, with a clear message
            trained = load_trained(meta["source"])
        else:
            trained = load_trained(source)
        # the data first: a run without calibration data stops before any work is done
        held_out = trained.load_data(data, "no data to calibrate and evaluate with")
        fp32 = source if source.suffix == ".onnx" else export(trained, "onnx", Path(tmp) / "model.onnx",
                                                              dynamic_batch=True)
        out = Path(out) if out else trained.source.with_name(f"model.{kind}.onnx")
        extra = {}
        if kind == "int8":
            calibration = calibration_sample(held_out.train_images, calibration_images)
            quantize_int8(fp32, out, calibration, per_channel=per_channel)
            extra = {"calibration_images": len(calibration), "per_channel": per_channel}
        else:
            convert_fp16(fp32, out)
        metadata_path(out).write_text(json.dumps({**json.loads(metadata_path(fp32).read_text()),
                                                  "format": f"onnx-{kind}", **extra}, indent=2) + "\n")
        device = evaluation_device(kind, device, runtime)
        return {"artifact": str(out), "device": device, "runtime": runtime, **extra,
                **compare({"fp32": fp32, kind: out}, held_out.test_images, held_out.test_labels, device, runtime)}
