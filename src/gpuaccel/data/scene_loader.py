"""Batches of detection and segmentation data that live on the compute device, augmented there.

A whole split sits on the device as uint8 images with their padded boxes and labels, or their
masks; a batch is one gather per field. Training batches are flipped, zoomed (in: a crop; out:
the image shrunk inside a border of the mean colour) and shifted by one affine resampling
(``grid_sample``) per batch, and the boxes and masks are moved by the same transform, so they
stay on their objects. Boxes that leave the frame are clipped; a box left with less than
``KEEP_VISIBLE`` of its area (or under 2 pixels a side) is dropped from that batch (label -1).
Brightness and contrast jitter follow. No host work per step, whatever the object counts.

The batches are a resident loader's (``runtime.loaders.ResidentLoader`` over :func:`scene_tensors`,
with :class:`SceneBatches` as its transform): its order, sharding over processes and per-batch
seeds, so a run resumes at any step with the same batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .augment import color_jitter
from ..errors import GpuaccelError
from .loader import Normaliser, resident_budget

KEEP_VISIBLE = 0.35  # of a box's area, for it to stay an object after a crop


@dataclass
class SceneAugment:
    flip: bool = True  # mirror half the images left to right
    zoom: float = 0.0  # scale each image by a factor from 1 - zoom to 1 + zoom (log-uniform), at a random place
    brightness: float = 0.0
    contrast: float = 0.0

    @property
    def active(self) -> bool:
        return self.flip or self.zoom > 0 or self.brightness > 0 or self.contrast > 0


def random_affine(n: int, zoom: float, flip: bool, generator: torch.Generator, device) -> tuple[torch.Tensor, ...]:
    """Per image: the share ``s`` of the frame's side that the output shows (below 1: zoomed in),
    where its window starts (``x0``, ``y0``, as shares of the side; negative when zoomed out),
    and whether it is mirrored."""
    u = torch.rand((n, 4), device=device, generator=generator)
    if zoom > 0:
        low, high = math.log(1 - min(zoom, 0.9)), math.log(1 + zoom)
        s = torch.exp(low + (high - low) * u[:, 0])
    else:
        s = torch.ones(n, device=device)
    x0, y0 = u[:, 1] * (1 - s), u[:, 2] * (1 - s)
    mirrored = (u[:, 3] < 0.5) if flip else torch.zeros(n, dtype=torch.bool, device=device)
    return s, x0, y0, mirrored


def resample(x: torch.Tensor, s, x0, y0, mirrored, mode: str = "bilinear") -> torch.Tensor:
    """``x`` (N, C, H, W) seen through each image's window (``random_affine``), outside the frame 0."""
    n = x.shape[0]
    sign = torch.where(mirrored, -1.0, 1.0)
    theta = torch.zeros((n, 2, 3), device=x.device)
    # input coordinate = s * output coordinate + shift, in grid_sample's -1..1 units
    theta[:, 0, 0], theta[:, 0, 2] = s * sign, s - 1 + 2 * x0
    theta[:, 1, 1], theta[:, 1, 2] = s, s - 1 + 2 * y0
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode=mode, padding_mode="zeros", align_corners=False)


def move_boxes(boxes: torch.Tensor, labels: torch.Tensor, size: tuple[int, int], s, x0, y0, mirrored):
    """Boxes (N, M, 4) in pixels through the same windows: scaled, shifted, mirrored, clipped to
    the frame; those mostly outside it are dropped (zero box, label -1)."""
    h, w = size
    sx = (s * w)[:, None]
    sy = (s * h)[:, None]
    left = (boxes[..., 0] - (x0 * w)[:, None]) / sx * w
    right = (boxes[..., 2] - (x0 * w)[:, None]) / sx * w
    top = (boxes[..., 1] - (y0 * h)[:, None]) / sy * h
    bottom = (boxes[..., 3] - (y0 * h)[:, None]) / sy * h
    flip = mirrored[:, None]
    left, right = torch.where(flip, w - right, left), torch.where(flip, w - left, right)
    moved = torch.stack([left, top, right, bottom], -1)
    clipped = torch.stack([left.clamp(0, w), top.clamp(0, h), right.clamp(0, w), bottom.clamp(0, h)], -1)
    area = lambda b: (b[..., 2] - b[..., 0]).clamp_min(0) * (b[..., 3] - b[..., 1]).clamp_min(0)
    keep = (labels >= 0) & (area(clipped) >= KEEP_VISIBLE * area(moved)) & \
        (clipped[..., 2] - clipped[..., 0] >= 2) & (clipped[..., 3] - clipped[..., 1] >= 2)
    return torch.where(keep[..., None], clipped, 0.0), torch.where(keep, labels, -1)


def scene_tensors(split, device: torch.device) -> tuple:
    """A :class:`~gpuaccel.data.scenes.SceneSplit` on ``device``, one tensor per field: (uint8
    images, (boxes, labels)) for detection, (uint8 images, masks) for segmentation."""
    needed = split.images.nbytes + (split.masks.nbytes if split.masks is not None else 0)
    if needed > resident_budget(device):
        raise GpuaccelError(f"detection and segmentation data are kept in the device's memory; these "
                            f"{len(split)} images need {needed / 2**30:.1f} GiB, more than half of what is free "
                            f"there: pass a smaller --image-size")
    images = torch.from_numpy(split.images).to(device)
    if split.masks is None:
        return images, (torch.from_numpy(split.boxes).to(device), torch.from_numpy(split.labels).to(device))
    return images, torch.from_numpy(split.masks).to(device)


class SceneBatches:
    """What a gathered batch of :func:`scene_tensors` becomes on the device (a resident loader's
    transform): normalised images, and for training batches (those with a seed) the images
    flipped, zoomed and jittered with their boxes or masks moved alike."""

    def __init__(self, *, mean, std, device: torch.device, dtype: torch.dtype = torch.float32,
                 channels_last: bool = False, augment: SceneAugment | None = None):
        self.normaliser = Normaliser(mean, std, device, dtype, channels_last)
        self.augment = augment if augment is not None and augment.active else None

    def __call__(self, batch: tuple, seed: int | None) -> tuple:
        images, targets = batch
        x = self.normaliser.scale(images)
        if self.augment is not None and seed is not None:
            x, targets = self._augmented(x, targets, torch.Generator(device=x.device).manual_seed(seed))
        return self.normaliser.finish(x), targets

    def _augmented(self, x: torch.Tensor, targets, generator: torch.Generator):
        aug = self.augment
        window = random_affine(x.shape[0], aug.zoom, aug.flip, generator, x.device)
        if aug.zoom > 0:
            x = resample(x, *window)
        elif aug.flip:  # (a mirror alone needs no resampling)
            x = torch.where(window[3][:, None, None, None], x.flip(-1), x)
        if isinstance(targets, tuple):  # (detection: boxes and labels; segmentation: masks)
            targets = move_boxes(*targets, tuple(x.shape[2:]), *window)
        elif aug.zoom > 0:
            targets = resample(targets[:, None].float(), *window, mode="nearest")[:, 0].to(targets.dtype)
        elif aug.flip:
            targets = torch.where(window[3][:, None, None], targets.flip(-1), targets)
        x = color_jitter(x, aug.brightness, aug.contrast, generator, self.normaliser.pixel_range)
        return x, targets
