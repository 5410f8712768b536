"""Recordings with a class each: a folder or .tar[.gz] of .wav files (data/audio.py), decoded,
resampled and fitted to one length once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..data.audio import is_audio_source, load_audio
from ..data.kinds import DataKind, register_kind
from ..errors import GpuaccelError
from ..runtime.loaders import ResidentLoader
from ..train.inputs import TrainingInputs, cache_dir_of, shared_read


class Audio(DataKind):
    name = "audio"
    settings = ("label_pattern", "test_where", "sample_rate", "clip_seconds", "skip_bad")
    detect_order = 40
    description = "recordings with a class each (a folder or .tar.gz of .wav files)"
    default_model = "audio_tcnn"
    default_task = "classification"

    def detect(self, path: Path) -> str | None:
        return self.name if is_audio_source(path) else None

    def open(self, config, path, fmt, *, dist=None) -> TrainingInputs:
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
