"""Export a trained model (ONNX, torch.export .pt2, TorchScript) and verify the result
against the original on real held-out images."""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path

import numpy as np
import torch

from ..errors import GpuaccelError, choice_error
from ..files import make_directory, replaced_atomically, write_json
from .artifact import TrainedModel
from .runners import FORMAT_SUFFIX, load_runner, metadata_path

FORMATS = tuple(FORMAT_SUFFIX)
AGREEMENT_REQUIRED = 0.999
BATCH = torch.export.Dim("batch", min=1, max=65536)


def export(trained: TrainedModel, fmt: str, out: Path, *, dynamic_batch: bool = True, static_batch: int = 2,
           opset: int | None = None) -> Path:
    """Writes the artefact and, beside it, ``<name>.json`` with class names and input shape.
    The artefact takes any batch size, or (``dynamic_batch=False``, for runtimes that need it)
    exactly ``static_batch`` images."""
    if not dynamic_batch and static_batch < 1:
        raise GpuaccelError(f"--static-batch must be at least 1, got {static_batch}")
    if fmt not in FORMATS:
        raise choice_error("export format", fmt, FORMATS)
    out = Path(out)
    make_directory(out.parent)
    example = trained.example_input(2 if dynamic_batch else static_batch)
    module = trained.task.deployed(trained.module.eval())
    write_artifact(fmt, module, example, out, {"x": {0: BATCH}} if dynamic_batch else None, opset)
    meta = {"classes": trained.classes, "in_channels": trained.in_channels, "image_size": trained.image_size,
            "model": trained.model_name, "task": trained.task.describe(), "format": fmt,
            "dynamic_batch": dynamic_batch,
            "batch_size": None if dynamic_batch else static_batch,
            "input": "float32 (N, C, H, W) in [0, 1]; normalisation is inside the model",
            "source": str(trained.source)}
    write_json(metadata_path(out), meta)
    return out


def write_artifact(fmt: str, module, example, out: Path, dynamic_shapes: dict | None, opset: int | None = None,
                   formats=FORMATS) -> None:
    """Exports ``module`` traced with ``example`` (its one argument) as ``fmt``;
    ``dynamic_shapes``: {argument name: {dimension: torch.export.Dim}}, or None for static shapes."""
    try:
        with _quiet_exporters(), replaced_atomically(out) as tmp:  # a killed export leaves the old file
            _write(fmt, module, example, tmp, dynamic_shapes, opset)
    except GpuaccelError:
        raise
    except OSError as exc:  # the file, not the model: a read-only directory, a full disk
        raise GpuaccelError(f"cannot write {out}: {exc.strerror or exc}") from None
    except Exception as exc:  # an operator or construct the format cannot express
        reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        others = ", ".join(f for f in formats if f != fmt)
        raise GpuaccelError(f"the model cannot be exported as {fmt}: {reason}; try --format {others}") from None


def _write(fmt: str, module, example, out: Path, dynamic_shapes, opset) -> None:
    if fmt == "onnx":
        _require("onnxscript")
        program = torch.onnx.export(module, (example,), dynamo=True, opset_version=opset,
                                    dynamic_shapes=dynamic_shapes, verbose=False)
        program.save(str(out))
    elif fmt == "pt2":
        program = torch.export.export(module, (example,), dynamic_shapes=dynamic_shapes)
        torch.export.save(program, str(out))
    else:
        torch.jit.trace(module, example).save(str(out))


@contextlib.contextmanager
def _quiet_exporters():
    """PyTorch's exporters report what a user cannot act on: the ONNX registry notes, operator
    by operator, that torchvision is not installed, and torch.export's pytree code warns about
    a deprecated check inside itself (LeafSpec). Both are silenced here, nothing else."""
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
            yield
    finally:
        logger.setLevel(level)


def _require(module: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise GpuaccelError(f"ONNX export needs {module}: pip install 'gpuaccel[deploy]'")


def verify(trained: TrainedModel, artifact: Path, images: np.ndarray, *, batch_size: int = 256,
           dynamic_batch: bool = True, static_batch: int = 2) -> dict:
    """Runs the original and the exported model on the same images (uint8 NCHW) and compares
    logits and top-1 predictions. A fixed-batch export is fed batches of its own size."""
    runner = load_runner(artifact)
    if not dynamic_batch:
        batch_size = static_batch  # the example batch the export was traced with
        images = images[: len(images) - len(images) % batch_size]
    batches = (images[start:start + batch_size].astype(np.float32) / 255.0 for start in range(0, len(images), batch_size))
    return compare_outputs(trained.module, runner, batches, "images")


def artifact_caller(path: Path, fmt: str):
    """``call(inputs) -> outputs`` (numpy in and out) of an ONNX artefact in ONNX Runtime on the
    CPU, or of a .pt2 artefact through torch.export."""
    if fmt == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        return lambda x: session.run(None, {name: x})[0]
    exported = torch.export.load(str(path)).module()
    return lambda x: exported(torch.from_numpy(x)).detach().numpy()


def compare_outputs(model: torch.nn.Module, call, batches, unit: str) -> dict:
    """The original ``model`` (eval mode, CPU) against an artefact's ``call`` on the same inputs
    (numpy ``batches``): top-1 agreement and output differences; it passes at >= 99.9% agreement."""
    agree, count, diffs = 0, 0, []
    with torch.no_grad():
        for batch in batches:
            reference = model(torch.from_numpy(batch)).float().numpy()
            result = call(batch)
            agree += int((reference.argmax(1) == result.argmax(1)).sum())
            count += len(batch)
            diffs.append(np.abs(reference - result).reshape(-1))
    diff = np.concatenate(diffs)
    return {unit: count, "top1_agreement": agree / count, "max_abs_diff": float(diff.max()),
            "mean_abs_diff": float(diff.mean()), "passed": agree / count >= AGREEMENT_REQUIRED}

