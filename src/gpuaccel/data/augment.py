"""Batch augmentation as a few tensor ops, on whatever device the batch is on.

Every op takes the batch and a ``torch.Generator`` on the batch's device, so a batch's
augmentation is a pure function of (seed, epoch, step): the same on every resume, and
no host work or host-device copy in the training step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FLIP_MODES = ("none", "random", "alternate")


@dataclass
class AugmentConfig:
    """``crop_padding`` P: pad by P pixels (reflect) and crop back at a random offset, i.e.
    translate by up to P. ``flip``: none, random (each image with p=0.5) or alternate
    (a random half flipped on even epochs, the other half on odd epochs: every image is
    seen both ways every two epochs). ``cutout`` S: zero one random SxS square (after
    normalisation, i.e. set to the mean)."""

    crop_padding: int = 0
    flip: str = "none"
    cutout: int = 0

    @property
    def active(self) -> bool:
        return self.crop_padding > 0 or self.flip != "none" or self.cutout > 0


def random_crop(x: torch.Tensor, padding: int, generator: torch.Generator) -> torch.Tensor:
    """Translates each image by up to ``padding`` pixels, filling with its reflection."""
    if padding <= 0:
        return x
    n, c, h, w = x.shape
    padded = F.pad(x, (padding,) * 4, mode="reflect") if x.is_floating_point() else \
        F.pad(x.float(), (padding,) * 4, mode="reflect").to(x.dtype)
    dy = torch.randint(0, 2 * padding + 1, (n,), device=x.device, generator=generator)
    dx = torch.randint(0, 2 * padding + 1, (n,), device=x.device, generator=generator)
    rows = (dy[:, None] + torch.arange(h, device=x.device))[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, None, :]
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    channel = torch.arange(c, device=x.device)[None, :, None, None]
    return padded[batch, channel, rows, cols]


def flip_mask(indices: torch.Tensor, epoch: int, mode: str, seed: int, generator: torch.Generator) -> torch.Tensor:
    """Which images of the batch to mirror. ``indices`` are the images' positions in the data set."""
    if mode == "random":
        return torch.rand(indices.shape, device=indices.device, generator=generator) < 0.5
    if mode == "alternate":
        # a fixed pseudo-random bit per image (a multiplicative hash of index and seed), xor epoch parity
        bits = ((indices * 2654435761 + seed * 40503) >> 7) & 1
        return (bits ^ (epoch & 1)).bool()
    return torch.zeros(indices.shape, dtype=torch.bool, device=indices.device)


def apply_flip(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask[:, None, None, None], x.flip(-1), x)


def cutout(x: torch.Tensor, size: int, generator: torch.Generator, fill: torch.Tensor | float = 0) -> torch.Tensor:
    """Sets one ``size`` x ``size`` square per image, centred anywhere (clipped at the edges), to
    ``fill`` (a scalar or a per-channel (1, C, 1, 1) tensor: the mean pixel before normalisation)."""
    if size <= 0:
        return x
    n, _, h, w = x.shape
    cy = torch.randint(0, h, (n,), device=x.device, generator=generator)
    cx = torch.randint(0, w, (n,), device=x.device, generator=generator)
    ys = torch.arange(h, device=x.device)[None, :]
    xs = torch.arange(w, device=x.device)[None, :]
    in_y = (ys >= (cy - size // 2)[:, None]) & (ys < (cy - size // 2 + size)[:, None])
    in_x = (xs >= (cx - size // 2)[:, None]) & (xs < (cx - size // 2 + size)[:, None])
    hole = in_y[:, :, None] & in_x[:, None, :]
    if isinstance(fill, torch.Tensor):
        return torch.where(hole[:, None], fill.to(x.dtype), x)
    return x.masked_fill(hole[:, None], fill)


def augment_batch(x: torch.Tensor, indices: torch.Tensor, epoch: int, config: AugmentConfig, seed: int,
                  generator: torch.Generator, fill: torch.Tensor | float = 0) -> torch.Tensor:
    """Crop/translate, flip and cutout, in that order, drawing from ``generator``."""
    x = random_crop(x, config.crop_padding, generator)
    if config.flip != "none":
        x = apply_flip(x, flip_mask(indices, epoch, config.flip, seed, generator))
    return cutout(x, config.cutout, generator, fill)
