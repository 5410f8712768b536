"""Exporting any run ``gpuaccel train`` made (an image, text or audio classifier) and verifying the
artefact against the original model on held-out data."""

from __future__ import annotations

from pathlib import Path

from ..errors import choice_error
from ..files import run_directory_lock
from ..tasks import SCENE_TASKS
from .artifact import load_trained, run_kind
from .export import FORMAT_SUFFIX, FORMATS, export, verify


def export_run(checkpoint, fmt: str = "onnx", out=None, *, data: str | None = None, verify_count: int = 1000,
               static_batch: int | None = None, opset: int | None = None) -> tuple[dict, str]:
    """Exports the run (a run directory, or its model.pt / checkpoint.pt) as ``fmt`` and verifies it
    on ``verify_count`` held-out samples of ``data`` (default: the run's). Returns (the report,
    what was compared: 'images', 'sentences' or 'recordings'). Holds the run lock of the run
    directory it writes into."""
    source = Path(checkpoint)
    with run_directory_lock(Path(out).parent if out else source if source.is_dir() else source.parent):
        return _export_run(checkpoint, fmt, out, data=data, verify_count=verify_count, static_batch=static_batch,
                           opset=opset)


def _export_run(checkpoint, fmt, out, *, data, verify_count, static_batch, opset) -> tuple[dict, str]:
    kind = run_kind(checkpoint)
    if kind == "text":
        from .text import export_text_classifier

        return export_text_classifier(checkpoint, fmt, out, data=data, verify_sentences=verify_count,
                                      opset=opset), "sentences"
    if kind == "audio":
        from .audio import export_audio_classifier

        return export_audio_classifier(checkpoint, fmt, out, data=data, verify_recordings=verify_count,
                                       opset=opset), "recordings"
    if kind in SCENE_TASKS:
        from .vision import export_scene_model

        return export_scene_model(checkpoint, fmt, out, data=data, verify_count=verify_count,
                                  static_batch=static_batch, opset=opset)
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
    return report, "images"

