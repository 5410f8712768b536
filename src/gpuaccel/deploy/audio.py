"""Audio classifiers at inference and export. Recordings are made like the training ones
(mono, the run's sample rate, centred in silence or cut to the run's clip length); the model
takes the waveforms and computes its own features, so an export needs nothing beside it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..data import parse_spec
from ..data.audio import load_audio
from ..errors import GpuaccelError
from ..train.config import saved_settings
from ..files import make_directory, write_json
from .artifact import load_run_state, rebuild_model

AUDIO_FORMATS = ("onnx", "pt2")


def audio_classifier_state(run) -> tuple[dict, Path]:
    state, path = load_run_state(run)
    if not state.get("audio") or not state.get("classes"):
        raise GpuaccelError(f"{path} is not an audio classifier")
    return state, path


def export_audio_classifier(run, fmt: str, out: Path | None = None, *, data: str | None = None,
                            verify_recordings: int = 1000, opset: int | None = None) -> dict:
    """Exports a run's audio classifier (waveforms in, any batch size; logits out) and checks it
    against the original on held-out recordings (top-1 agreement >= 99.9%)."""
    from .export import BATCH, artifact_caller, compare_outputs, write_artifact
    from .runners import FORMAT_SUFFIX, metadata_path

    if fmt not in AUDIO_FORMATS:
        raise GpuaccelError(f"an audio classifier exports as {' or '.join(AUDIO_FORMATS)}, not {fmt}")
    state, path = audio_classifier_state(run)
    model = rebuild_model(state, path).eval()
    audio = state["audio"]
    out = Path(out) if out else path.with_name(f"model{FORMAT_SUFFIX[fmt]}")
    make_directory(out.parent)
    example = torch.randn(2, audio["clip_samples"]) * 0.1
    write_artifact(fmt, model, example, out, {"waves": {0: BATCH}}, opset, formats=AUDIO_FORMATS)
    write_json(metadata_path(out), {
        "classes": state["classes"], "model": state["model_name"], "task": state["task"], "format": fmt,
        "input": f"float32 (N, {audio['clip_samples']}) mono waveforms in [-1, 1] at {audio['sample_rate']} Hz, "
                 f"shorter recordings centred in silence", **audio, "source": str(path)})
    held = held_out_recordings(state, data, "cannot load held-out recordings to verify the export")
    waves = held.test_waves[:verify_recordings]
    batches = np.split(waves, range(256, len(waves), 256))
    report = compare_outputs(model, artifact_caller(out, fmt), batches, "recordings")
    return {**report, "artifact": str(out), "format": fmt, "size_bytes": out.stat().st_size}


def held_out_recordings(state: dict, data: str | None, why: str):
    """An audio classifier's data set (``data``, default the run's) made as in training:
    ``train_waves``, ``test_waves``, ``test_labels``. ``why`` opens the error."""
    from ..data.cache import default_cache_dir

    config, audio = saved_settings(state["config"]), state["audio"]
    try:
        _, data_path = parse_spec(data or config["data"])
        return load_audio(data_path, label_pattern=config.get("label_pattern"), test_where=config.get("test_where"),
                          sample_rate=audio["sample_rate"], clip_seconds=audio["clip_samples"] / audio["sample_rate"],
                          val_split=config.get("val_split"), skip_bad=config.get("skip_bad", False),
                          seed=config.get("seed", 0), cache_dir=default_cache_dir())
    except GpuaccelError as exc:
        raise GpuaccelError(f"{why} ({exc}); pass --data SPEC") from None
