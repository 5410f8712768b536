"""Smaller ONNX models with ONNX Runtime's tools: post-training static int8 quantisation
calibrated on real training samples, and fp16 conversion for GPU runtimes, for every kind of
classifier ``export`` makes (images, sentences, recordings).

int8: the fp32 ONNX model is pre-processed (shape inference, graph optimisation), then
weights and activations are quantised (QDQ format: uint8 activations, int8 weights, per
tensor or per output channel), with activation ranges from calibration batches of
training samples. fp16: weights and computation in half precision, inputs and outputs
kept as they were (casts at the edges), so the artefact is used exactly like the fp32 one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import GpuaccelError
from ..files import replaced_atomically, run_directory_lock, scratch_directory, write_json


# What int8 quantises, by what a model takes (None: every operator ONNX Runtime can). Text: the
# matrix products and embedding lookups; its attention masks hold -inf, which a quantised Add or
# Softmax cannot represent (the calibrated range would be infinite). Audio: the convolutions and
# the classifier; the log-mel front end (a MatMul of the power spectrum with the mel filters)
# stays float, as its energies span decades that 8 bits cannot hold (quantised, it took the
# three-tone recordings of tests/tasks/test_audio.py to 74% accuracy; with it float, the test's 80% holds).
INT8_OPS = {"images": None, "sentences": ("MatMul", "Gemm", "Conv", "Gather"), "recordings": ("Conv", "Gemm")}


def quantize_int8(fp32_model: Path, out: Path, calibration: np.ndarray, *, per_channel: bool = False,
                  batch_size: int = 32, prepare=None, op_types: tuple[str, ...] | None = None) -> Path:
    """``calibration``: training samples as stored (uint8 images (N, C, H, W) by default);
    ``prepare`` turns a batch of them into the model's input (default: images to [0, 1]);
    ``op_types``: the operators to quantise (default: every kind ONNX Runtime can)."""
    if calibration is None or len(calibration) == 0:
        raise GpuaccelError("int8 quantisation needs calibration samples and none are available; "
                            "pass --data SPEC with the training data")
    try:
        from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType, quantize_static)
        from onnxruntime.quantization.shape_inference import quant_pre_process
    except ImportError:
        raise GpuaccelError("int8 quantisation needs onnxruntime: pip install 'gpuaccel[deploy]'") from None
    import onnxruntime as ort

    from .infer import images_for_model

    prepare = prepare or images_for_model
    input_name = ort.InferenceSession(str(fp32_model), providers=["CPUExecutionProvider"]).get_inputs()[0].name

    class Batches(CalibrationDataReader):
        def __init__(self):
            self.starts = iter(range(0, len(calibration), batch_size))

        def get_next(self):
            start = next(self.starts, None)
            if start is None:
                return None
            return {input_name: prepare(calibration[start:start + batch_size])}

    with scratch_directory(out) as scratch:
        prepared = scratch / "prepared.onnx"
        quant_pre_process(str(fp32_model), str(prepared), skip_symbolic_shape=True)
        # reduce_range: weights in 7 bits. On x86 CPUs without VNNI (AVX2 only, AVX-512 without
        # it) ONNX Runtime multiplies uint8 by int8 in pairs summed in 16 bits, which saturate
        # with 8-bit weights: there the three-tone test recordings fell from >= 80% to 74%; the
        # artefact runs wherever it is copied, so its weights leave that headroom everywhere
        with replaced_atomically(out) as tmp:  # a killed quantisation leaves the old file
            quantize_static(str(prepared), str(tmp), Batches(), quant_format=QuantFormat.QDQ,
                            per_channel=per_channel, reduce_range=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            op_types_to_quantize=list(op_types) if op_types else None)
    return Path(out)


def convert_fp16(fp32_model: Path, out: Path) -> Path:
    try:
        import onnx
        from onnxruntime.transformers.float16 import convert_float_to_float16
    except ImportError:
        raise GpuaccelError("fp16 conversion needs onnx and onnxruntime: pip install 'gpuaccel[deploy]'") from None
    half = convert_float_to_float16(onnx.load(str(fp32_model)), keep_io_types=True)
    with replaced_atomically(out) as tmp:
        onnx.save(half, str(tmp))
    return Path(out)


def calibration_sample(train: np.ndarray, count: int) -> np.ndarray:
    """``count`` training samples spread over the whole set (a fixed random choice, in order)."""
    picks = np.random.default_rng(0).permutation(len(train))[:count]
    return train[np.sort(picks)]


def compare(models: dict, held, device: str = "cpu", runtime: str = "onnxruntime") -> dict:
    """Size, held-out accuracy and speed in ``runtime`` on ``device`` of each ONNX file in
    ``models`` (name -> path), on ``held`` (:class:`~gpuaccel.deploy.heldout.HeldOut`)."""
    from ..bench.timing import measure
    from .infer import predict, top1_accuracy
    from .runners import load_runner

    report = {}
    for name, path in models.items():
        runner = load_runner(path, device, runtime=runtime)
        probs, _ = predict(runner, held.test, prepare=held.prepare)
        speed = measure(runner, held.example, repeats=100)
        report[name] = {"size_bytes": Path(path).stat().st_size,
                        "test_accuracy": top1_accuracy(probs, held.test_labels),
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


def quantize_model(source, kind: str, *, calibration_samples: int = 512, per_channel: bool = False,
                   data: str | None = None, out=None, device: str | None = None,
                   runtime: str = "onnxruntime", say=None) -> dict:
    """Quantises a trained classifier (a run, or an .onnx that 'gpuaccel export' made) to ``kind``
    ('int8': ONNX Runtime's static quantisation calibrated on ``calibration_samples`` training
    samples; 'fp16': for GPU runtimes), writes the artefact and its .json beside it, and compares
    both versions' size, held-out accuracy and speed in ``runtime`` (:func:`compare`). ``say(line)``
    hears what it is doing, stage by stage (a ResNet's int8 takes minutes on a CPU)."""
    import json

    from .exports import export_run
    from .heldout import held_out
    from .runners import check_runtime, load_runner, metadata_path

    check_runtime(runtime)
    source = Path(source)
    run = source
    if source.suffix == ".onnx":
        if not source.exists():
            raise GpuaccelError(f"model file {source} does not exist")
        meta = json.loads(metadata_path(source).read_text()) if metadata_path(source).exists() else {}
        if "source" not in meta:
            raise GpuaccelError(f"{source} has no {metadata_path(source).name} naming its checkpoint; "
                                f"export it with 'gpuaccel export'")
        load_runner(source)  # a corrupt file fails here, with a clear message
        run = Path(meta["source"])
    # the data first: a run without calibration data stops before any work is done
    held = held_out(run, data, "no data to calibrate and evaluate with")
    out = Path(out) if out else held.checkpoint.with_name(f"model.{kind}.onnx")
    say = say or (lambda line: None)
    with run_directory_lock(out.parent), scratch_directory(out) as scratch:
        if source.suffix != ".onnx":
            say("exporting the model to ONNX (fp32) and verifying it")
        fp32 = source if source.suffix == ".onnx" else Path(
            export_run(run, "onnx", scratch / "model.onnx", data=data, verify_count=256,
                       keep_unverified=True)[0]["artifact"])
        extra = {}
        if kind == "int8":
            calibration = calibration_sample(held.train, calibration_samples)
            say(f"calibrating and quantising to int8 on {len(calibration)} training {held.unit}")
            quantize_int8(fp32, out, calibration, per_channel=per_channel, prepare=held.prepare,
                          op_types=INT8_OPS[held.unit])
            extra = {"calibration_samples": len(calibration), "per_channel": per_channel}
        else:
            say("converting to fp16")
            convert_fp16(fp32, out)
        write_json(metadata_path(out), {**json.loads(metadata_path(fp32).read_text()),
                                        "format": f"onnx-{kind}", **extra})
        device = evaluation_device(kind, device, runtime)
        say(f"evaluating and timing both models in {runtime} on {device}")
        return {"artifact": str(out), "device": device, "runtime": runtime, "unit": held.unit, **extra,
                **compare({"fp32": fp32, kind: out}, held, device, runtime)}
