"""Export a trained model (ONNX, torch.export .pt2, TorchScript) and verify the result
against the original on real held-out images."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
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
OUTPUT_TOLERANCE = 1e-2  # the largest output difference an export may show, relative to the outputs' size
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
        raise GpuaccelError(export_refusal(exc, fmt, formats)) from None


def export_refusal(exc: BaseException, fmt: str, formats=FORMATS) -> str:
    """One line saying why ``fmt`` refused the model: for a branch on a tensor's value (what
    torch.export cannot record, and TorchScript would record only one way), where it is and
    what to do; else the first line of the exporter's own message, without its colours."""
    chain, seen = [], exc
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    branch = next((e for e in chain if type(e).__name__ == "GuardOnDataDependentSymNode"
                   or "data-dependent" in str(e).splitlines()[0] if str(e).strip()), None)
    if branch is not None:
        where = re.findall(r'File "([^"]+)", line (\d+)', str(branch))
        user = [f"{Path(f).name}:{n}" for f, n in where if "/torch/" not in f and "/gpuaccel/" not in f]
        return (f"the model cannot be exported as {fmt}: its forward pass branches on a tensor's value"
                f"{' (' + user[-1] + ')' if user else ''}, which an exported graph cannot hold; write the branch as "
                f"tensor operations (torch.where, or torch.cond for two sub-networks) and export again (torchscript "
                f"would keep only the branch its example took)")
    first = next((e for e in chain if str(e).strip()), exc)
    reason = re.sub(r"\x1b\[[0-9;]*m", "", str(first).strip().splitlines()[0])[:300] if str(first).strip() \
        else type(exc).__name__
    others = ", ".join(f for f in formats if f != fmt)
    return f"the model cannot be exported as {fmt}: {reason}; try --format {others}"


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
    # (and torch's symbolic shapes print the whole traced graph as a warning where a branch on a
    # tensor's value stops the export: the refusal says it in one line instead)
    loggers = [logging.getLogger(name) for name in ("torch.onnx._internal.exporter._registration",
                                                    "torch.fx.experimental.symbolic_shapes")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    # torch.export also prints the partial graph of a refused model to standard error itself:
    # what the exporters print is held back, and passed on only when the export succeeds
    held = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(held):
            warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
            yield
        sys.stderr.write(held.getvalue())
    finally:
        for logger, level in zip(loggers, levels):
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
    (numpy ``batches``): top-1 agreement and output differences; it passes at >= 99.9% agreement with
    every output within 1% of the largest output (or 0.01)."""
    agree, count, diffs, scale = 0, 0, [], 0.0
    with torch.no_grad():
        for batch in batches:
            reference = model(torch.from_numpy(batch)).float().numpy()
            scale = max(scale, float(np.abs(reference).max()))
            result = call(batch)
            agree += int((reference.argmax(1) == result.argmax(1)).sum())
            count += len(batch)
            diffs.append(np.abs(reference - result).reshape(-1))
    diff = np.concatenate(diffs)
    # the outputs must also be close, not only rank alike: a trace that kept one branch of the
    # model may still pick the same classes on one data set
    close = float(diff.max()) <= OUTPUT_TOLERANCE * max(1.0, scale)
    return {unit: count, "top1_agreement": agree / count, "max_abs_diff": float(diff.max()),
            "mean_abs_diff": float(diff.mean()), "outputs_close": close,
            "passed": agree / count >= AGREEMENT_REQUIRED and close}

