"""A run's data as its deployed model takes it, for every kind of classifier ``export`` accepts:
training samples to calibrate int8 with, held-out samples and labels to evaluate on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import GpuaccelError
from ..tasks import SCENE_TASKS
from .artifact import load_trained, run_kind
from .infer import ids_for_model, images_for_model, waves_for_model


@dataclass
class HeldOut:
    unit: str  # "images", "sentences", "recordings"
    train: np.ndarray  # as stored: uint8 images, 0-padded token ids, waveforms
    test: np.ndarray
    test_labels: np.ndarray
    prepare: Callable[[np.ndarray], np.ndarray]  # a batch as stored -> what the model takes
    checkpoint: Path  # the run's model.pt (or checkpoint.pt)

    def batches(self, samples: np.ndarray, batch_size: int):
        for start in range(0, len(samples), batch_size):
            yield self.prepare(samples[start:start + batch_size])

    def example(self, batch: int) -> np.ndarray:
        """``batch`` held-out samples (repeated where there are fewer), as the model takes them:
        inputs for timing."""
        return self.prepare(np.resize(self.test, (batch, *self.test.shape[1:])))


def held_out(run, data: str | None, why: str) -> HeldOut:
    """The data set of ``run`` (a run directory or its checkpoint), or ``data`` instead, split as
    in training. ``why`` opens the error message when it cannot be read."""
    kind = run_kind(run)
    if kind in SCENE_TASKS:
        raise GpuaccelError(f"{run} is a {kind} model: 'gpuaccel export' and 'gpuaccel infer' take it; "
                            f"quantize, prune and bench-infer work on classifiers")
    if kind == "text":
        from .text import held_out_sentences, text_classifier_state

        state, path = text_classifier_state(run)
        s = held_out_sentences(state, data, why)
        return HeldOut("sentences", s.train_ids, s.test_ids, s.test_labels, ids_for_model, path)
    if kind == "audio":
        from .audio import audio_classifier_state, held_out_recordings

        state, path = audio_classifier_state(run)
        a = held_out_recordings(state, data, why)
        return HeldOut("recordings", a.train_waves, a.test_waves, a.test_labels, waves_for_model, path)
    trained = load_trained(run)
    d = trained.load_data(data, why)
    return HeldOut("images", d.train_images, d.test_images, d.test_labels, images_for_model, trained.source)
