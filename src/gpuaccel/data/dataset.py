"""The in-memory form every reader produces: uint8 images in NCHW order plus labels."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import GpuaccelError


@dataclass
class ImageDataset:
    """A decoded image-classification data set with a training and an evaluation split.

    Images are uint8 arrays of shape (N, C, H, W); labels are int64 in [0, num_classes).
    ``test_*`` is the held-out split: the data set's own test split, or a stratified
    share of the training data carved out by ``--val-split`` where it has none.
    """

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    classes: list[str]
    source: str = ""
    skipped: list[str] = field(default_factory=list)
    held_out: str = "its test split"  # which images are the held-out split, in words

    def __post_init__(self) -> None:
        # torch.from_numpy needs writable arrays; readers may hand over read-only buffers
        self.train_images = np.require(self.train_images, requirements=("C", "W"))
        self.test_images = np.require(self.test_images, requirements=("C", "W"))
        self.train_labels = np.asarray(self.train_labels, dtype=np.int64)
        self.test_labels = np.asarray(self.test_labels, dtype=np.int64)
        for split, images, labels in (("training", self.train_images, self.train_labels),
                                      ("test", self.test_images, self.test_labels)):
            if len(images) == 0:
                raise GpuaccelError(f"{self.source or self.name}: the {split} split is empty")
            if images.dtype != np.uint8 or images.ndim != 4:
                raise ValueError(f"{split} images must be uint8 (N, C, H, W), got {images.dtype} {images.shape}")
            if len(images) != len(labels):
                raise GpuaccelError(f"{self.source or self.name}: {len(images)} {split} images but {len(labels)} labels")
            bad = (labels < 0) | (labels >= len(self.classes))
            if bad.any():
                raise GpuaccelError(
                    f"{self.source or self.name}: {split} label {int(labels[bad][0])} is out of range for "
                    f"{len(self.classes)} classes (labels must be 0..{len(self.classes) - 1})")
        if self.train_images.shape[1:] != self.test_images.shape[1:]:
            raise GpuaccelError(
                f"{self.source or self.name}: training images are {self.train_images.shape[1:]} (C, H, W) "
                f"but test images are {self.test_images.shape[1:]}")

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def in_channels(self) -> int:
        return int(self.train_images.shape[1])

    @property
    def image_size(self) -> int:
        """The larger side in pixels: what models use to pick a stem."""
        return int(max(self.train_images.shape[2:]))

    def channel_stats(self) -> tuple[list[float], list[float]]:
        """Per-channel mean and standard deviation of (about 10,000 of) the training images, on a
        0..1 scale. Computed from each channel's histogram of its 256 values: the same numbers as
        the mean and deviation of the pixels as floats, without making them floats (a noticeable
        part of every CIFAR-10 command on a small CPU)."""
        sample = self.train_images[:: max(1, len(self.train_images) // 10000)]
        levels = np.arange(256, dtype=np.float64) / 255.0
        means, stds = [], []
        for c in range(sample.shape[1]):
            weights = np.bincount(sample[:, c].ravel(), minlength=256) / (sample[:, c].size or 1)
            mean = float(weights @ levels)
            means.append(mean)
            stds.append(max(float(np.sqrt(weights @ (levels - mean) ** 2)), 1e-3))
        return means, stds

    def describe(self) -> str:
        c, h, w = self.train_images.shape[1:]
        return (f"{self.name}: {len(self.train_images)} train / {len(self.test_images)} test images, "
                f"{c}x{h}x{w}, {self.num_classes} classes")


def stratified_split(images: np.ndarray, labels: np.ndarray, fraction: float, seed: int):
    """Hold out ``fraction`` of every class (at least one image of each class that has two)."""
    if not 0.0 < fraction < 1.0:
        raise GpuaccelError(f"--val-split must be between 0 and 1 (exclusive), got {fraction}")
    rng = np.random.default_rng(seed)
    held_out = []
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        rng.shuffle(members)
        count = int(round(len(members) * fraction))
        if len(members) > 1:
            count = min(max(count, 1), len(members) - 1)
        held_out.append(members[:count])
    test_mask = np.zeros(len(labels), dtype=bool)
    test_mask[np.concatenate(held_out)] = True
    return images[~test_mask], labels[~test_mask], images[test_mask], labels[test_mask]
