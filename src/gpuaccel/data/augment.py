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
    return gather_moved(x, torch.arange(len(x), device=x.device), AugmentConfig(crop_padding=padding),
                        AugmentDraws(crop=_crop_offsets(len(x), padding, generator, x.device)))


def _crop_offsets(n: int, padding: int, generator: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    dy = torch.randint(0, 2 * padding + 1, (n,), device=device, generator=generator)
    dx = torch.randint(0, 2 * padding + 1, (n,), device=device, generator=generator)
    return dy, dx


def _reflected(position: torch.Tensor, size: int) -> torch.Tensor:
    """Positions up to ``size - 1`` outside 0..size-1 mirrored back in about the edge pixel (as
    reflect padding fills them: -1 reads 1)."""
    position = position.abs()
    return torch.where(position > size - 1, 2 * (size - 1) - position, position)


def gather_moved(images: torch.Tensor, which: torch.Tensor, config: AugmentConfig, draws: AugmentDraws,
                 mirror: torch.Tensor | None = None) -> torch.Tensor:
    """``images[which]``, each translated by its crop offsets (``config.crop_padding``: reflect
    padding, cropped back) and mirrored where ``mirror`` (or ``draws.flip``) says, read from
    ``images`` in one gather in their own dtype. The same values as padding, cropping and
    flipping ``images[which]``, without making those copies: a uint8 source is read as bytes, and
    can be normalised after."""
    n, (c, h, w), device = len(which), images.shape[1:], images.device
    rows = torch.arange(h, device=device).expand(n, h)
    cols = torch.arange(w, device=device).expand(n, w)
    if draws.crop is not None:
        dy, dx = draws.crop
        rows = _reflected(rows + (dy - config.crop_padding)[:, None], h)
        cols = _reflected(cols + (dx - config.crop_padding)[:, None], w)
    mirror = draws.flip if mirror is None else mirror
    if mirror is not None:
        cols = torch.where(mirror[:, None], cols.flip(-1), cols)
    channels = torch.arange(c, device=device)
    return images[which[:, None, None, None], channels[None, :, None, None], rows[:, None, :, None],
                  cols[:, None, None, :]]


def flip_mask(indices: torch.Tensor, epoch: int, mode: str, seed: int, generator: torch.Generator) -> torch.Tensor:
    """Which images of the batch to mirror. ``indices`` are the images' positions in the data set."""
    if mode == "random":
        return torch.rand(indices.shape, device=indices.device, generator=generator) < 0.5
    if mode == "alternate":
        # a fixed pseudo-random bit per image (a multiplicative hash of index and seed), xor epoch parity
        bits = ((indices * 2654435761 + seed * 40503) >> 7) & 1
        return (bits ^ (epoch & 1)).bool()
    return torch.zeros(indices.shape, dtype=torch.bool, device=indices.device)


def cutout(x: torch.Tensor, size: int, generator: torch.Generator, fill: torch.Tensor | float = 0) -> torch.Tensor:
    """Sets one ``size`` x ``size`` square per image, centred anywhere (clipped at the edges), to
    ``fill`` (a scalar or a per-channel (1, C, 1, 1) tensor: the mean pixel before normalisation)."""
    if size <= 0:
        return x
    return _cutout(x, size, *_cutout_centres(x.shape, generator, x.device), fill)


def _cutout_centres(shape, generator: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    n, _, h, w = shape
    cy = torch.randint(0, h, (n,), device=device, generator=generator)
    cx = torch.randint(0, w, (n,), device=device, generator=generator)
    return cy, cx


def _cutout(x: torch.Tensor, size: int, cy: torch.Tensor, cx: torch.Tensor,
            fill: torch.Tensor | float = 0) -> torch.Tensor:
    _, _, h, w = x.shape
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
    return _jitter(x, *_jitter_factors(len(x), brightness, contrast, generator, x.device), unit, mean)


def _jitter_factors(n: int, brightness: float, contrast: float, generator: torch.Generator, device):
    shift = (torch.rand((n, 1, 1, 1), device=device, generator=generator) * 2 - 1) * brightness
    scale = 1 + (torch.rand((n, 1, 1, 1), device=device, generator=generator) * 2 - 1) * contrast
    return shift, scale


def _jitter(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, unit: torch.Tensor | float = 1.0,
            mean: torch.Tensor | float = 0.0) -> torch.Tensor:
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


@dataclass
class AugmentDraws:
    """A batch's random choices (or several batches' end to end): crop offsets, random flips,
    cutout centres, brightness shifts and contrast scales; None where the config draws none."""

    crop: tuple[torch.Tensor, torch.Tensor] | None = None
    flip: torch.Tensor | None = None
    cutout: tuple[torch.Tensor, torch.Tensor] | None = None
    jitter: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def draw(shape, config: AugmentConfig, generator: torch.Generator, device) -> "AugmentDraws":
        """One batch's draws from ``generator``, in the order :func:`augment_batch` makes them."""
        n = shape[0]
        crop = _crop_offsets(n, config.crop_padding, generator, device) if config.crop_padding > 0 else None
        flip = torch.rand((n,), device=device, generator=generator) < 0.5 if config.flip == "random" else None
        holes = _cutout_centres(shape, generator, device) if config.cutout > 0 else None
        jitter = _jitter_factors(n, config.brightness, config.contrast, generator, device) \
            if config.brightness > 0 or config.contrast > 0 else None
        return AugmentDraws(crop, flip, holes, jitter)

    @staticmethod
    def joined(draws: list["AugmentDraws"]) -> "AugmentDraws":
        """Several batches' draws as one batch's (their images end to end)."""
        if len(draws) == 1:
            return draws[0]

        def cat(parts):
            if parts[0] is None:
                return None
            if isinstance(parts[0], tuple):
                return tuple(torch.cat(column) for column in zip(*parts))
            return torch.cat(parts)
        return AugmentDraws(*(cat([getattr(d, f) for d in draws]) for f in ("crop", "flip", "cutout", "jitter")))


def apply_augmentation(x: torch.Tensor, indices: torch.Tensor, epoch: int, config: AugmentConfig, seed: int,
                       draws: AugmentDraws, fill: torch.Tensor | float = 0, *, unit: torch.Tensor | float = 1.0,
                       mean: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Crop/translate, flip, cutout, brightness and contrast, in that order, as ``draws`` chose
    them: one pass over any number of images (a batch, or several batches end to end).
    ``indices``: the images' positions in the data set (alternate flips)."""
    mirror = alternate_flips(indices, epoch, config, seed)
    if draws.crop is not None or draws.flip is not None or mirror is not None:
        x = gather_moved(x, torch.arange(len(x), device=x.device), config, draws, mirror)
    return apply_pixel_changes(x, config, draws, fill, unit=unit, mean=mean)


def alternate_flips(indices: torch.Tensor, epoch: int, config: AugmentConfig, seed: int) -> torch.Tensor | None:
    """Which images ``flip: alternate`` mirrors this epoch (None for the other flip modes)."""
    return flip_mask(indices, epoch, "alternate", seed, None) if config.flip == "alternate" else None


def apply_pixel_changes(x: torch.Tensor, config: AugmentConfig, draws: AugmentDraws, fill: torch.Tensor | float = 0,
                        *, unit: torch.Tensor | float = 1.0, mean: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Cutout, brightness and contrast as ``draws`` chose them (what follows the crop and flip)."""
    if draws.cutout is not None:
        x = _cutout(x, config.cutout, *draws.cutout, fill)
    if draws.jitter is not None:
        jittered = _jitter(x.float(), *draws.jitter, unit, mean)
        x = jittered if x.is_floating_point() else jittered.round_().clamp_(0, 255).to(x.dtype)
    return x


def augment_batch(x: torch.Tensor, indices: torch.Tensor, epoch: int, config: AugmentConfig, seed: int,
                  generator: torch.Generator, fill: torch.Tensor | float = 0, size: int | None = None, *,
                  unit: torch.Tensor | float = 1.0, mean: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Crop/translate, flip, cutout, brightness and contrast, in that order, drawing from
    ``generator``; then scaled to ``size`` (see :func:`color_jitter` for ``unit`` and ``mean``)."""
    draws = AugmentDraws.draw(x.shape, config, generator, x.device)
    return resize(apply_augmentation(x, indices, epoch, config, seed, draws, fill, unit=unit, mean=mean), size)
