"""Batch loaders that keep the data set where the compute is.

A :class:`DeviceLoader` holds a whole split as one uint8 tensor. When it fits on the
GPU (``place_images`` decides) every step is a gather, the augmentation ops and a
normalisation, all on the GPU: no host work, no host-device copy, no synchronisation.
When it does not fit, the uint8 images stay in pinned host memory and each batch is
gathered on the host and copied on a side stream one step ahead of its use.

The order of batches is a pure function of (seed, epoch), and each batch's
augmentation of (seed, epoch, step), so training can stop at any step and resume at
the next one with exactly the same data. With ``world_size`` > 1 each rank takes a
disjoint shard of every epoch's permutation.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from . import augment as aug
from .augment import AugmentConfig

_EPOCH_SALT = 1_000_003
_STEP_SALT = 7_919


def place_images(images: torch.Tensor, device: torch.device, max_share: float = 0.5, force: str = "auto") -> torch.Tensor:
    """Moves a uint8 image tensor onto ``device`` if it takes under ``max_share`` of the free
    memory there (or ``force == 'gpu'``); otherwise pins it in host memory."""
    if device.type != "cuda" or force == "cpu":
        return images.pin_memory() if device.type == "cuda" else images
    free, _total = torch.cuda.mem_get_info(device)
    if force == "gpu" or images.numel() * images.element_size() < max_share * free:
        return images.to(device, non_blocking=False)
    return images.pin_memory()


class DeviceLoader:
    """Shuffled (training) or ordered (evaluation) batches of normalised images.

    ``images``: uint8 (N, C, H, W) on the compute device or on the host; ``labels``: int64 (N,).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, batch_size: int, device: torch.device,
                 mean, std, train: bool, dtype: torch.dtype = torch.float32, augment: AugmentConfig | None = None,
                 channels_last: bool = False, seed: int = 0, drop_last: bool | None = None,
                 rank: int = 0, world_size: int = 1):
        self.images, self.labels = images, labels.to(images.device)
        self.device, self.dtype = device, dtype
        self.batch_size, self.train, self.seed = batch_size, train, seed
        self.augment = augment if (train and augment is not None and augment.active) else None
        self.channels_last = channels_last
        self.rank, self.world_size = rank, world_size
        shape = (1, -1, 1, 1)
        self.mean = torch.tensor(mean, dtype=torch.float32, device=device).view(shape) * 255.0
        self.inv_std = 1.0 / (torch.tensor(std, dtype=torch.float32, device=device).view(shape) * 255.0)
        # dropping the ragged last batch keeps every training step the same shape (compile, graphs)
        self.drop_last = (train and self.shard_size > batch_size) if drop_last is None else drop_last

    @property
    def num_images(self) -> int:
        return int(self.labels.shape[0])

    @property
    def shard_size(self) -> int:
        """Images per rank per epoch. Training pads the permutation so every rank has as many;
        evaluation splits the images exactly, so shards differ by at most one."""
        if self.train:
            return math.ceil(self.num_images / self.world_size)
        return len(range(self.rank, self.num_images, self.world_size))

    def __len__(self) -> int:
        if self.drop_last:
            return self.shard_size // self.batch_size
        return math.ceil(self.shard_size / self.batch_size)

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        """This rank's image indices for ``epoch``, in the order they are served."""
        if not self.train:
            return torch.arange(self.rank, self.num_images, self.world_size)
        generator = torch.Generator().manual_seed(self.seed * _EPOCH_SALT + epoch)
        order = torch.randperm(self.num_images, generator=generator)
        total = self.shard_size * self.world_size
        if total > self.num_images:  # wrap around so all ranks take the same number of steps
            order = torch.cat([order, order[: total - self.num_images]])
        return order[self.rank::self.world_size]

    def normalised_sample(self, count: int) -> torch.Tensor:
        """The first ``count`` images of a fixed random order, normalised, on the compute device
        (for data-dependent initialisation such as patch whitening)."""
        idx = torch.randperm(self.num_images, generator=torch.Generator().manual_seed(self.seed))[:count]
        x = self.images[idx.to(self.images.device)].to(self.device)
        return (x.float() - self.mean) * self.inv_std

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yields (images, labels) on the compute device, from batch ``start`` of ``epoch``."""
        order = self.epoch_indices(epoch).to(self.images.device)
        steps = len(self)
        on_host = self.images.device != self.device
        stream = torch.cuda.Stream(self.device) if on_host and self.device.type == "cuda" else None

        def fetch(step):
            idx = order[step * self.batch_size:(step + 1) * self.batch_size]
            x, y = self.images[idx], self.labels[idx]
            if on_host:
                if stream is not None:
                    x, y = x.pin_memory(), y.pin_memory()
                    with torch.cuda.stream(stream):
                        x, y, idx = (t.to(self.device, non_blocking=True) for t in (x, y, idx))
                else:
                    x, y, idx = x.to(self.device), y.to(self.device), idx.to(self.device)
            return x, y, idx

        pending = fetch(start) if start < steps else None
        for step in range(start, steps):
            x, y, idx = pending
            if stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(stream)
                for t in (x, y, idx):
                    t.record_stream(torch.cuda.current_stream(self.device))
            pending = fetch(step + 1) if step + 1 < steps else None
            yield self._prepare(x, idx, epoch, step), y

    def _prepare(self, x: torch.Tensor, idx: torch.Tensor, epoch: int, step: int) -> torch.Tensor:
        x = (x.float() - self.mean) * self.inv_std
        if self.augment is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed((self.seed * _EPOCH_SALT + epoch) * _STEP_SALT + step * self.world_size + self.rank)
            x = aug.random_crop(x, self.augment.crop_padding, generator)
            if self.augment.flip != "none":
                x = aug.apply_flip(x, aug.flip_mask(idx, epoch, self.augment.flip, self.seed, generator))
            x = aug.cutout(x, self.augment.cutout, generator)
        x = x.to(self.dtype)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x
