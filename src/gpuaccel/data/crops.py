"""Crop geometry and batched, antialiased resampling for images of any size, on any device.

Training takes a random-resized crop of each image (a box covering 8-100% of its area
with an aspect ratio in [3/4, 4/3], as in the Inception/ResNet ImageNet recipes) and
resizes it to ``size`` x ``size``; evaluation resizes the shorter side to ``size / 0.875``
and takes the centre ``size`` x ``size``. Both are "resample this box of each image to a
square", so one resampler serves both.

The resampler is PIL's antialiased bilinear filter (a triangle whose support widens with
the downscaling factor) written as two weight matrices per image, so a whole batch of
differently sized images is resampled with two batched matrix products on the GPU. A
horizontal flip is the column-weight matrix reversed, i.e. free.
"""

from __future__ import annotations

import math
import warnings

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


def resample_boxes(images: list[torch.Tensor], boxes: torch.Tensor, size: int,
                   flip: torch.Tensor | None = None) -> torch.Tensor:
    """Resamples box i of ``images[i]`` ((C, H, W) uint8, sizes may differ, all on one device)
    to ``size`` x ``size``; ``flip`` (N,) bool mirrors those outputs. Returns (N, C, size, size)
    float32 in 0..255.

    Images are sorted by area and padded into one canvas per chunk of similar sizes; each
    chunk is two batched matrix products (fp16 on a GPU: 0..255 is exact, the taps carry ~11
    bits). The host does a fixed amount of work per chunk, not per image: on a GPU the
    per-batch parameters go over in one pinned copy, and whole images (contiguous) are packed
    with one concatenation, because a kernel launch per image cost more host time than the
    resampling itself took on the GPU."""
    n = len(images)
    device = images[0].device
    channels = images[0].shape[0]
    on_gpu = device.type == "cuda"
    dtype = torch.float16 if on_gpu else torch.float32
    heights = np.array([im.shape[1] for im in images])
    widths = np.array([im.shape[2] for im in images])
    order = np.argsort(heights * widths, kind="stable")
    by_area = torch.from_numpy(order)
    # per image, in area order: box (top, left, height, width), extent (height, width), flip
    params = torch.empty(n, 7, dtype=torch.float32, pin_memory=on_gpu)
    params[:, :4] = boxes[by_area]
    params[:, 4] = torch.from_numpy(heights[order])
    params[:, 5] = torch.from_numpy(widths[order])
    params[:, 6] = 0.0 if flip is None else flip[by_area].float()
    params = params.to(device, non_blocking=True)
    resampled = torch.empty(n, channels, size, size, device=device)
    for a, b in _chunks(heights[order], widths[order], channels):
        h_max, w_max = int(heights[order[a:b]].max()), int(widths[order[a:b]].max())
        canvas = _canvas([images[i] for i in order[a:b]], h_max, w_max, dtype)
        box = params[a:b]
        rows = _axis_weights(box[:, 0], box[:, 2], box[:, 4], size, h_max, dtype)
        cols = _axis_weights(box[:, 1], box[:, 3], box[:, 5], size, w_max, dtype)
        cols = torch.where(box[:, 6, None, None] > 0, cols.flip(1), cols)
        resampled[a:b] = rows[:, None] @ canvas @ cols[:, None].transpose(-1, -2)
    if n == 1 or (order == np.arange(n)).all():
        return resampled
    place = (by_area.pin_memory() if on_gpu else by_area).to(device, non_blocking=True)
    return torch.empty_like(resampled).index_copy_(0, place, resampled)


def _chunks(heights: np.ndarray, widths: np.ndarray, channels: int) -> list[tuple[int, int]]:
    """[start, stop) runs of images (sorted by area) whose padded canvas fits the budget; an
    image larger than the budget is a chunk of its own."""
    chunks, start, h_max, w_max = [], 0, 0, 0
    for i, (h, w) in enumerate(zip(heights.tolist(), widths.tolist())):
        grown_h, grown_w = max(h_max, h), max(w_max, w)
        if i > start and (i - start + 1) * channels * grown_h * grown_w > _CANVAS_BUDGET:
            chunks.append((start, i))
            start, grown_h, grown_w = i, h, w
        h_max, w_max = grown_h, grown_w
    chunks.append((start, len(heights)))
    return chunks


def _canvas(images: list[torch.Tensor], h_max: int, w_max: int, dtype: torch.dtype) -> torch.Tensor:
    """The images zero-padded to one (N, C, h_max, w_max) tensor of ``dtype``: one packing
    copy, one conversion and one padding kernel (nested tensors), whatever N is. The
    conversion comes first because PyTorch pads float nested tensors on the GPU in one kernel
    but integer ones image by image (a kernel launch each)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors warn that their API is a prototype
        nested = torch.nested.as_nested_tensor(images).to(dtype)
    return nested.to_padded_tensor(0, (len(images), images[0].shape[0], h_max, w_max))
