"""Recordings with a class each: a folder or .tar[.gz] of .wav files (data/audio.py), decoded,
resampled and fitted to one length once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..data.audio import is_audio_source, load_audio
from ..data.kinds import DataKind, register_kind
from ..errors import GpuaccelError
from ..runtime.loaders import ResidentLoader
from ..settings import setting

if TYPE_CHECKING:
    from ..train.inputs import TrainingInputs


@dataclass
class AudioOptions:
    """The settings only recordings read: labels from file names, the test split, rate and length."""
    label_pattern: str | None = setting(
        None, "recordings: take each label from the file name, e.g. '{label}_{speaker}_{index}.wav' (default: "
        "from the class folder, train/<class>/*.wav)", metavar="PATTERN")
    test_where: str | None = setting(None, "recordings with --label-pattern: which files are the test split, "
                                           "by the pattern's fields, e.g. 'index<5'", metavar="CONDITION")
    sample_rate: int | None = setting(None, "recordings: resample every recording to this rate (default: the "
                                            "most common rate in the data)", metavar="HZ")
    clip_seconds: float | None = setting(None, "recordings: centre shorter recordings in silence and cut "
                                               "longer ones to their loudest stretch of this length (default: "
                                               "the length 99% of the training recordings fit in)", metavar="SECONDS")


class Audio(DataKind):
    name = "audio"
    settings = ("skip_bad",)
    options = AudioOptions
    detect_order = 40
    description = "recordings with a class each (a folder or .tar.gz of .wav files)"
    default_model = "audio_tcnn"
    default_task = "classification"

    def validate_options(self, data) -> None:
        rate = data.sample_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int) or rate < 1000):
            raise GpuaccelError(f"--sample-rate is in Hz, a whole number >= 1000, got {rate}")
        if data.clip_seconds is not None and not data.clip_seconds > 0:
            raise GpuaccelError(f"--clip-seconds must be positive, got {data.clip_seconds}")
        if data.test_where is not None and data.label_pattern is None:
            raise GpuaccelError("--test-where needs --label-pattern: its fields come from the file names")

    def detect(self, path: Path) -> str | None:
        return self.name if is_audio_source(path) else None

    def open(self, config, path, fmt, *, dist=None) -> TrainingInputs:
        from ..train.inputs import TrainingInputs, cache_dir_of, shared_read  # (train/config.py imports the kinds)
        data = shared_read(dist, lambda: load_audio(
            path, label_pattern=config.data.label_pattern, test_where=config.data.test_where,
            sample_rate=config.data.sample_rate,
            clip_seconds=config.data.clip_seconds, val_split=config.data.val_split, skip_bad=config.data.skip_bad,
            seed=config.loop.seed, cache_dir=cache_dir_of(config)))
        if config.loop.tta:
            raise GpuaccelError("--tta flips and shifts images; for recordings leave it at 0 (the model's time shift "
                                "augments in training)")
        identity = {"classes": data.classes, "train_samples": len(data.train_labels),
                    "test_samples": len(data.test_labels), "sample_rate": data.sample_rate,
                    "clip_samples": data.clip_samples,
                    "label_counts": np.bincount(data.train_labels, minlength=data.num_classes).tolist(),
                    "files": data.fingerprint}

        def build(config, *, device, dtype, channels_last, rank, world_size):
            common = dict(device=device, seed=config.loop.seed, rank=rank, world_size=world_size)
            return (ResidentLoader((torch.from_numpy(data.train_waves), torch.from_numpy(data.train_labels)),
                                   batch_size=config.loop.batch_size, train=True, **common),
                    ResidentLoader((torch.from_numpy(data.test_waves), torch.from_numpy(data.test_labels)),
                                   batch_size=config.loop.eval_batch_size, train=False, **common))

        return TrainingInputs(
            name=data.name, description=data.describe(), train_samples=len(data.train_labels),
            test_samples=len(data.test_labels),
            model_args={"num_classes": data.num_classes, "sample_rate": data.sample_rate}, identity=identity,
            classes=data.classes, task="classification", unit="recordings", default_model="audio_tcnn",
            audio={"sample_rate": data.sample_rate, "clip_samples": data.clip_samples}, build=build,
            data_kind=self.name)

    def owned_before_kinds(self, state: dict) -> bool:
        return bool(state.get("audio"))

    def export(self, run, fmt, out, *, data, verify_count, static_batch, opset):
        from ..deploy.audio import export_audio_classifier

        return export_audio_classifier(run, fmt, out, data=data, verify_recordings=verify_count, opset=opset), \
            "recordings"

    def held_out(self, run, data, why):
        from ..deploy.audio import audio_classifier_state, held_out_recordings
        from ..deploy.heldout import HeldOut
        from ..deploy.infer import waves_for_model

        state, path = audio_classifier_state(run)
        a = held_out_recordings(state, data, why)
        return HeldOut("recordings", a.train_waves, a.test_waves, a.test_labels, waves_for_model, path)


register_kind(Audio())
