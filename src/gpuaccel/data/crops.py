"""Crop geometry and batched, antialiased resampling for images of any size, on any device.

Training takes a random-resized crop of each image (a box covering 8-100% of its area
with an aspect ratio in [3/4, 4/3], as in the Inception/ResNet ImageNet recipes) and
resizes it to ``size`` x ``size``; evaluation resizes the shorter side to ``size / 0.875``
and takes the centre ``size`` x ``size``. Both are "resample this box of each image to a
square", so one resampler serves both.

The resampler is PIL's antialiased bilinear filter (a triangle whose support widens with
the downscaling factor). On a GPU with Triton it is one kernel that reads every image of a
batch in place (:mod:`resample_kernel`); elsewhere it is written as two weight matrices
per image, so a whole batch of differently sized images is resampled with two batched
matrix products. A horizontal flip is the column-weight matrix reversed, i.e. free.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch


SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
EVAL_CROP_FRACTION = 0.875  # the 224-of-256 centre crop
_ATTEMPTS = 10
_CANVAS_BUDGET = 96 * 2**20  # canvas elements per resampling chunk (192 MiB in fp16)


def random_resized_boxes(heights: torch.Tensor, widths: torch.Tensor, generator: torch.Generator,
                         scale=SCALE, ratio=RATIO) -> torch.Tensor:
    """(N, 4) float boxes (top, left, height, width) in whole pixels, one per image.

    Up to ten draws of area share and log-uniform aspect ratio per image, the first that fits
    wins; an image where none fits gets the largest centred box with a ratio in range."""
    n = heights.shape[0]
    heights, widths = heights.double(), widths.double()
    area = heights * widths
    share = torch.empty(n, _ATTEMPTS, dtype=torch.float64).uniform_(scale[0], scale[1], generator=generator)
    log_ratio = torch.empty(n, _ATTEMPTS, dtype=torch.float64).uniform_(
        math.log(ratio[0]), math.log(ratio[1]), generator=generator)
    aspect = log_ratio.exp()
    w = torch.sqrt(area[:, None] * share * aspect).round()
    h = torch.sqrt(area[:, None] * share / aspect).round()
    fits = (w > 0) & (h > 0) & (w <= widths[:, None]) & (h <= heights[:, None])
    first = fits.double().argmax(dim=1)  # the first attempt that fits (0 if none does)
    pick = torch.arange(n)
    h, w, found = h[pick, first], w[pick, first], fits.any(dim=1)

    # the fallback: the whole image, trimmed to the nearest allowed aspect ratio
    image_ratio = widths / heights
    fb_w = torch.where(image_ratio > ratio[1], (heights * ratio[1]).round(), widths)
    fb_h = torch.where(image_ratio < ratio[0], (widths / ratio[0]).round(), heights)
    h, w = torch.where(found, h, fb_h), torch.where(found, w, fb_w)

    offsets = torch.rand(n, 2, dtype=torch.float64, generator=generator)
    top = torch.where(found, (offsets[:, 0] * (heights - h + 1)).floor(), ((heights - h) / 2).floor())
    left = torch.where(found, (offsets[:, 1] * (widths - w + 1)).floor(), ((widths - w) / 2).floor())
    return torch.stack([top, left, h, w], dim=1).float()


def centre_boxes(heights: torch.Tensor, widths: torch.Tensor, size: int,
                 crop_fraction: float = EVAL_CROP_FRACTION) -> torch.Tensor:
    """(N, 4) boxes of "resize the shorter side to round(size / crop_fraction), then take the
    centre size x size" (torchvision's Resize + CenterCrop, same rounding), in each image's
    own pixels, so that one resampling of the box does both."""
    heights, widths = heights.double(), widths.double()
    short = float(round(size / crop_fraction))
    portrait = heights > widths
    # the resized image: the shorter side becomes ``short``, the longer one is truncated
    resized_h = torch.where(portrait, (short * heights / widths).floor(), torch.full_like(heights, short))
    resized_w = torch.where(portrait, torch.full_like(widths, short), (short * widths / heights).floor())
    top = ((resized_h - size) / 2).round()
    left = ((resized_w - size) / 2).round()
    scale_y, scale_x = heights / resized_h, widths / resized_w
    return torch.stack([top * scale_y, left * scale_x, size * scale_y, size * scale_x], dim=1).float()


def _axis_weights(start: torch.Tensor, length: torch.Tensor, extent: torch.Tensor, out_size: int,
                  canvas: int, dtype: torch.dtype) -> torch.Tensor:
    """(N, out_size, canvas) rows of triangle-filter taps: output pixel j of image i samples the
    box [start, start + length) of an axis that has ``extent`` valid pixels (PIL's convention)."""
    device = start.device
    step = length / out_size
    support = step.clamp(min=1.0)  # downscaling widens the filter: that is the antialiasing
    centres = start[:, None] + (torch.arange(out_size, device=device) + 0.5) * step[:, None]
    pixels = torch.arange(canvas, device=device) + 0.5
    taps = (1.0 - (pixels[None, None, :] - centres[:, :, None]).abs() / support[:, None, None]).clamp(min=0.0)
    taps = taps * (pixels[None, None, :] < extent[:, None, None])
    return (taps / taps.sum(dim=2, keepdim=True).clamp(min=1e-12)).to(dtype)


@dataclass
class ImageTable:
    """A batch of (C, H, W) uint8 images where they lie, without a tensor per image.

    Row i of ``layout`` is (holder, offset, channel stride, row stride, column stride) of
    image i, in elements of ``holders[holder]``; row i of ``sizes`` is its (height, width).
    Rows are made with array arithmetic, so a batch costs the host the same whatever its
    size: on the GPU path the thread that prepares batches shares the GIL with the one that
    launches the training step."""

    holders: list[torch.Tensor]
    layout: np.ndarray  # (N, 5) int64
    sizes: np.ndarray  # (N, 2) int64
    channels: int = 3

    @classmethod
    def of(cls, images: list[torch.Tensor]) -> "ImageTable":
        """One holder per image, read through its own strides."""
        layout = np.array([(k, 0, *image.stride()) for k, image in enumerate(images)], dtype=np.int64)
        sizes = np.array([image.shape[1:] for image in images], dtype=np.int64)
        return cls(list(images), layout.reshape(-1, 5), sizes.reshape(-1, 2), images[0].shape[0] if images else 3)

    @classmethod
    def planar(cls, holder: torch.Tensor, sizes: np.ndarray, starts: np.ndarray) -> "ImageTable":
        """Three-channel images stored plane after plane from ``starts`` in ``holder`` (nvJPEG's RGB)."""
        heights, widths = sizes[:, 0].astype(np.int64), sizes[:, 1].astype(np.int64)
        layout = np.stack([np.zeros_like(heights), starts, heights * widths, widths, np.ones_like(heights)], axis=1)
        return cls([holder], layout, np.stack([heights, widths], axis=1))

    @classmethod
    def interleaved(cls, holder: torch.Tensor, shapes: np.ndarray) -> "ImageTable":
        """Height x width x channels images one after another in ``holder`` (Pillow's layout);
        a one-channel image is read three times, through a channel stride of 0."""
        heights, widths, channels = (shapes[:, k].astype(np.int64) for k in range(3))
        sizes = heights * widths * channels
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        layout = np.stack([np.zeros_like(heights), starts, np.where(channels == 1, 0, 1), widths * channels,
                           channels], axis=1)
        return cls([holder], layout, np.stack([heights, widths], axis=1))

    @classmethod
    def concat(cls, tables: list["ImageTable"]) -> "ImageTable":
        holders, layouts = [], []
        for table in tables:
            layout = table.layout.copy()
            layout[:, 0] += len(holders)
            holders += table.holders
            layouts.append(layout)
        return cls(holders, np.concatenate(layouts).reshape(-1, 5),
                   np.concatenate([t.sizes for t in tables]).reshape(-1, 2), tables[0].channels)

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def device(self) -> torch.device:
        return self.holders[0].device

    def take(self, rows) -> "ImageTable":
        """The images at ``rows``, in that order (a row may repeat)."""
        return ImageTable(self.holders, self.layout[rows], self.sizes[rows], self.channels)

    def addresses(self) -> np.ndarray:
        """(N, 4) int64: each image's address (bytes: the pixels are uint8) and its channel,
        row and column strides."""
        pointers = np.array([h.data_ptr() for h in self.holders], dtype=np.int64)
        return np.concatenate([(pointers[self.layout[:, 0]] + self.layout[:, 1])[:, None], self.layout[:, 2:]],
                              axis=1)

    def views(self) -> list[torch.Tensor]:
        """A (C, H, W) view per image."""
        return [torch.as_strided(self.holders[h], (self.channels, height, width), (cs, rs, col),
                                 self.holders[h].storage_offset() + offset)
                for (h, offset, cs, rs, col), (height, width) in zip(self.layout.tolist(), self.sizes.tolist())]


def resample_boxes(images: list[torch.Tensor] | ImageTable, boxes: torch.Tensor, size: int,
                   flip: torch.Tensor | None = None, method: str = "auto", *, affine: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32, channels_last: bool = False) -> torch.Tensor:
    """Resamples box i of image i ((C, H, W) uint8, sizes may differ, all on one device; a
    list or an :class:`ImageTable`) to ``size`` x ``size``; ``flip`` (N,) bool mirrors those
    outputs. Returns (N, C, size, size) float32 in 0..255; with ``affine`` ((2, C) float32 on
    the images' device), ``value * affine[0, c] + affine[1, c]`` instead (a normalisation), in
    ``dtype`` and, with ``channels_last``, that memory format.

    ``method``: "kernel" (one Triton kernel, :mod:`resample_kernel`, which does all of it in
    one pass), "matrices" (batched matrix products, any device) or "auto" (the kernel where
    Triton can run it)."""
    table = images if isinstance(images, ImageTable) else ImageTable.of(images)
    if method == "kernel" or (method == "auto" and table.device.type == "cuda"):
        from . import resample_kernel  # (here: importing Triton takes 0.2 s, which a CPU run need not spend)

        if method == "kernel" or resample_kernel.usable(table.device):
            return resample_kernel.resample_layout(table.addresses(), table.sizes, table.channels, table.device,
                                                   boxes, size, flip, affine, dtype, channels_last)
    if method not in ("auto", "matrices"):
        raise ValueError(f"unknown resampling method {method!r}")
    out = _resample_with_matrices(table.views() if isinstance(images, ImageTable) else images, boxes, size, flip)
    if affine is not None:
        out = out * affine[0].view(1, -1, 1, 1) + affine[1].view(1, -1, 1, 1)
    return out.to(dtype, memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _resample_with_matrices(images: list[torch.Tensor], boxes: torch.Tensor, size: int,
                            flip: torch.Tensor | None) -> torch.Tensor:
    """:func:`resample_boxes` with two batched matrix products per chunk of images.

    Only the pixels the filter can reach (each box widened by the filter's support) are
    used: they are padded into one canvas per chunk of similar sizes, and each chunk is two
    batched matrix products (fp16 on a GPU: 0..255 is exact, the taps carry ~11 bits)."""
    n = len(images)
    device = images[0].device
    channels = images[0].shape[0]
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    host_boxes = boxes.cpu().tolist()
    windows = [_window(im, box, size) for im, box in zip(images, host_boxes)]
    # per image: the box relative to its window, and the window's extent (what the taps need)
    placed = torch.tensor([[top - y0, left - x0, h, w, y1 - y0, x1 - x0]
                           for (top, left, h, w), (y0, y1, x0, x1) in zip(host_boxes, windows)],
                          dtype=torch.float32).to(device, non_blocking=True)
    flip = torch.zeros(n, dtype=torch.bool, device=device) if flip is None else flip.to(device, non_blocking=True)
    out = torch.empty(n, channels, size, size, device=device)
    heights = [y1 - y0 for y0, y1, _, _ in windows]
    widths = [x1 - x0 for _, _, x0, x1 in windows]
    chunk, h_max, w_max = [], 0, 0
    for i in sorted(range(n), key=lambda k: heights[k] * widths[k]):
        grown_h, grown_w = max(h_max, heights[i]), max(w_max, widths[i])
        if chunk and (len(chunk) + 1) * channels * grown_h * grown_w > _CANVAS_BUDGET:
            _resample_chunk(images, windows, chunk, h_max, w_max, placed, flip, size, dtype, out)
            chunk, grown_h, grown_w = [], heights[i], widths[i]
        chunk.append(i)
        h_max, w_max = grown_h, grown_w
    _resample_chunk(images, windows, chunk, h_max, w_max, placed, flip, size, dtype, out)
    return out


def _window(image: torch.Tensor, box: list[float], size: int) -> tuple[int, int, int, int]:
    """(y0, y1, x0, x1): the pixels the taps of ``box`` can reach, i.e. the box widened by the
    filter's support (one output pixel's footprint, at least one pixel), clipped to the image."""
    top, left, height, width = box
    reach_y, reach_x = max(1.0, height / size), max(1.0, width / size)
    return (max(0, math.floor(top - reach_y)), min(image.shape[1], math.ceil(top + height + reach_y)),
            max(0, math.floor(left - reach_x)), min(image.shape[2], math.ceil(left + width + reach_x)))


def _canvas(images: list[torch.Tensor], h_max: int, w_max: int, dtype: torch.dtype) -> torch.Tensor:
    """The images zero-padded to one (N, C, h_max, w_max) tensor: one packing copy and one
    padding kernel (nested tensors), whatever N is."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors warn that their API is a prototype
        nested = torch.nested.as_nested_tensor(images)
    return nested.to_padded_tensor(0, (len(images), images[0].shape[0], h_max, w_max)).to(dtype)


def _resample_chunk(images, windows, chunk, h_max, w_max, placed, flip, size, dtype, out) -> None:
    index_on_device = torch.tensor(chunk).to(out.device, non_blocking=True)
    members = []
    for i in chunk:
        y0, y1, x0, x1 = windows[i]
        members.append(images[i][:, y0:y1, x0:x1])
    canvas = _canvas(members, h_max, w_max, dtype)
    box = placed[index_on_device]
    rows = _axis_weights(box[:, 0], box[:, 2], box[:, 4], size, h_max, dtype)
    cols = _axis_weights(box[:, 1], box[:, 3], box[:, 5], size, w_max, dtype)
    cols = torch.where(flip[index_on_device][:, None, None], cols.flip(1), cols)
    resampled = rows[:, None] @ canvas @ cols[:, None].transpose(-1, -2)
    out[index_on_device] = resampled.float()
