"""A run's data as its deployed model takes it, for every kind of classifier ``export`` accepts:
training samples to calibrate int8 with, held-out samples and labels to evaluate on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .artifact import run_data_kind


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
    in training (its data kind makes it). ``why`` opens the error message when it cannot be read."""
    return run_data_kind(run).held_out(run, data, why)
