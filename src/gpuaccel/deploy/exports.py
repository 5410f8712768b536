"""Exporting any run ``gpuaccel train`` made and verifying the artefact against the original model on
held-out data: the run's data kind (``gpuaccel/kinds/``) exports it, with the pieces below and in
this package's modules."""

from __future__ import annotations

from pathlib import Path

from ..errors import GpuaccelError, choice_error
from ..files import owned_by_run, run_directory_lock
from .artifact import load_trained, run_data_kind
from .export import FORMAT_SUFFIX, FORMATS, export, verify


def export_run(checkpoint, fmt: str | None = None, out=None, *, data: str | None = None, verify_count: int = 1000,
               static_batch: int | None = None, opset: int | None = None,
               keep_unverified: bool = False) -> tuple[dict, str]:
    """Exports the run (a run directory, or its model.pt / checkpoint.pt) as ``fmt`` and verifies it
    on ``verify_count`` held-out samples of ``data`` (default: the run's). Returns (the report,
    what was compared: 'images', 'sentences' or 'recordings'). An artefact that fails its
    verification is removed (``report["removed"]``), so that nothing uses it by mistake, unless
    ``keep_unverified``. Holds the run lock of the run directory it writes into."""
    source = Path(checkpoint)
    if out is not None and owned_by_run(out):
        raise GpuaccelError(f"--out {out} is the run's own {Path(out).name}; export elsewhere (the default is "
                            f"model.onnx, model.pt2 or model.ts beside the run's model)")
    with run_directory_lock(Path(out).parent if out else source if source.is_dir() else source.parent):
        report, what = _export_run(checkpoint, fmt, out, data=data, verify_count=verify_count,
                                   static_batch=static_batch, opset=opset)
        if not report.get("passed", True) and not keep_unverified:
            artifact = Path(report["artifact"])
            for path in (artifact, artifact.with_name(artifact.name + ".json")):
                path.unlink(missing_ok=True)
            report["removed"] = True
        return report, what


def _export_run(checkpoint, fmt, out, *, data, verify_count, static_batch, opset) -> tuple[dict, str]:
    kind = run_data_kind(checkpoint)
    return kind.export(checkpoint, fmt or kind.export_format, out, data=data, verify_count=verify_count, static_batch=static_batch,
                       opset=opset)


def export_image_classifier(checkpoint, fmt: str, out=None, *, data: str | None = None, verify_count: int = 1000,
                            static_batch: int | None = None, opset: int | None = None) -> dict:
    """An image classifier exported as ``fmt`` (normalisation inside) and verified on held-out images."""
    if fmt not in FORMATS:
        raise choice_error("export format", fmt, FORMATS)
    trained = load_trained(checkpoint)
    out = Path(out) if out else trained.source.with_name(f"model{FORMAT_SUFFIX[fmt]}")
    held_out = trained.load_data(data, "cannot load held-out images to verify the export")
    static = static_batch is not None
    path = export(trained, fmt, out, dynamic_batch=not static, static_batch=static_batch or 2, opset=opset)
    report = verify(trained, path, held_out.test_images[:verify_count], dynamic_batch=not static,
                    static_batch=static_batch or 2)
    report.update(artifact=str(path), format=fmt, size_bytes=path.stat().st_size)
    return report
