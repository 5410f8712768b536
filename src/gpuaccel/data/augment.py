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
    normalisation, i.e. set to the mean). ``brightness`` B and ``contrast`` C: each image's
    pixels shifted by up to B of the full range, then its deviations from the data set's
    mean scaled by a factor in [1 - C, 1 + C]. ``sizes``: progressive resizing, as
    (size, epochs) stages: the first ``epochs`` of training on images scaled to size x size,
    the next stage's after, full size once the stages are done (see :meth:`size_at`)."""

    crop_padding: int = 0
    flip: str = "none"
    cutout: int = 0
    brightness: float = 0.0
    contrast: float = 0.0
    sizes: tuple[tuple[int, float], ...] = ()

    @property
    def active(self) -> bool:
        return self.crop_padding > 0 or self.flip != "none" or self.cutout > 0 or self.brightness > 0 \
            or self.contrast > 0 or bool(self.sizes)

    def size_at(self, epochs_done: float) -> int | None:
        """The side images are scaled to ``epochs_done`` epochs into training; None: as they are."""
        end = 0.0
        for size, epochs in self.sizes:
            end += epochs
            if epochs_done < end:
                return size
        return None


def parse_size_schedule(stages) -> tuple[tuple[int, float], ...]:
    """["24:3", "28:2"] (or [[24, 3], [28, 2]]) -> ((24, 3.0), (28, 2.0)): 3 epochs at 24 px,
    then 2 at 28. Raises ValueError naming a stage that is not SIZE:EPOCHS with SIZE >= 2 and
    EPOCHS > 0 (a size too small for the model fails where the model does)."""
    parsed = []
    for stage in stages or ():
        try:
            size, epochs = stage.split(":") if isinstance(stage, str) else stage
            size, epochs = int(size), float(epochs)
        except (TypeError, ValueError):
            raise ValueError(f"{stage!r} is not SIZE:EPOCHS (e.g. 24:3)") from None
        if size < 2 or not epochs > 0:
            raise ValueError(f"{stage!r}: the size must be at least 2 pixels and the epochs positive")
        parsed.append((size, epochs))
    return tuple(parsed)


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


def color_jitter(x: torch.Tensor, brightness: float, contrast: float, generator: torch.Generator,
                 unit: torch.Tensor | float = 1.0, mean: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Per image: adds U(-brightness, brightness) x ``unit`` (the full pixel range in ``x``'s
    scale, per channel), then scales the deviation from ``mean`` by U(1 - contrast, 1 + contrast).
    For normalised images ``mean`` is 0 and ``unit`` is 255 / std."""
    if brightness <= 0 and contrast <= 0:
        return x
    n = x.shape[0]
    shift = (torch.rand((n, 1, 1, 1), device=x.device, generator=generator) * 2 - 1) * brightness
    scale = 1 + (torch.rand((n, 1, 1, 1), device=x.device, generator=generator) * 2 - 1) * contrast
    return (x + shift * unit - mean) * scale + mean


def resize(x: torch.Tensor, size: int | tuple[int, int] | None) -> torch.Tensor:
    """Images scaled to ``size`` (a side, or (height, width); antialiased bilinear); as they are
    for None or their own size."""
    if size is None:
        return x
    size = (size, size) if isinstance(size, int) else tuple(size)
    if tuple(x.shape[-2:]) == size:
        return x
    scaled = F.interpolate(x.float(), size=size, mode="bilinear", antialias=True, align_corners=False)
    if not x.is_floating_point():
        scaled = scaled.round_().clamp_(0, 255)
    layout = torch.channels_last if x.dim() == 4 and not x.is_contiguous() and \
        x.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    return scaled.to(x.dtype).contiguous(memory_format=layout)


def augment_batch(x: torch.Tensor, indices: torch.Tensor, epoch: int, config: AugmentConfig, seed: int,
                  generator: torch.Generator, fill: torch.Tensor | float = 0, size: int | None = None, *,
                  unit: torch.Tensor | float = 1.0, mean: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Crop/translate, flip, cutout, brightness and contrast, in that order, drawing from
    ``generator``; then scaled to ``size`` (see :func:`color_jitter` for ``unit`` and ``mean``)."""
    x = random_crop(x, config.crop_padding, generator)
    if config.flip != "none":
        x = apply_flip(x, flip_mask(indices, epoch, config.flip, seed, generator))
    x = cutout(x, config.cutout, generator, fill)
    if config.brightness > 0 or config.contrast > 0:
        jittered = color_jitter(x.float(), config.brightness, config.contrast, generator, unit, mean)
        x = jittered if x.is_floating_point() else jittered.round_().clamp_(0, 255).to(x.dtype)
    return resize(x, size)
