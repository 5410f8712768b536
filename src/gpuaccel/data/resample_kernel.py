"""The resampler of :mod:`crops` as one Triton kernel, for images on a GPU.

Why a kernel: the matrix-product resampler first packs each image's window into a padded
canvas, and that costs host time per image (a view, a padding kernel through nested
tensors): about 13 ms per batch of 256 on an H200's host, on the thread that must also
call the JPEG decoder. Here each decoded image stays where nvJPEG left it; the kernel
finds it through a table of pointers and computes PIL's triangle-filter taps itself, so a
batch is one launch and the host builds a table of one row per image. The table holds
each image's strides too, so an image decoded on the CPU (height, width, channel order,
or one grey channel read three times) is read where it was uploaded, without a copy.

Output pixel (y, x) of image n is the sum over taps_y x taps_x source pixels of the
product of the row and column taps, divided by their sums (as PIL normalises each
axis), in fp32. A flipped output column reads the taps of its mirror column.

Needs Triton (it comes with PyTorch's CUDA wheels). With ``TRITON_INTERPRET=1`` set before
this module is imported, the same kernel runs on CPU tensors through Triton's interpreter:
that is how the tests check it on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of PyTorch come without Triton
    triton = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# output pixels per program; the interpreter runs programs one by one, so it gets big ones
_BLOCK = 8192 if _INTERPRETED else 512
_FIELDS = 7  # per image: height, width, box top, left, height, width, flip (float32)
_LAYOUT = 4  # per image: address, channel stride, row stride, column stride (int64, in elements)
# (a kernel argument must not be called "params": Triton 3.6's argument binder uses that name)


def usable(device: torch.device) -> bool:
    """Whether the kernel runs compiled on ``device`` (interpreted runs are for tests)."""
    return triton is not None and device.type == "cuda"


def resample_layout(layout, sizes, channels: int, device: torch.device, boxes: torch.Tensor, size: int,
                    flip: torch.Tensor | None = None) -> torch.Tensor:
    """The contract of :func:`gpuaccel.data.crops.resample_boxes`, for images given by
    ``layout`` ((N, 4) int64: address, channel, row and column stride, as
    :meth:`crops.ImageTable.addresses` makes it) and ``sizes`` ((N, 2): height, width):
    (N, channels, size, size) float32 in 0..255. The caller keeps the images alive."""
    n = len(sizes)
    if not (usable(device) or (triton is not None and _INTERPRETED)):
        raise RuntimeError(f"the Triton resampler cannot run on {device} here")
    boxes = boxes.detach().to("cpu", torch.float32)
    flip = torch.zeros(n) if flip is None else flip.to("cpu", torch.float32)
    geometry = torch.cat([torch.as_tensor(sizes, dtype=torch.float32), boxes, flip[:, None]], dim=1)
    layout = torch.as_tensor(layout, dtype=torch.int64)
    if device.type == "cuda":
        geometry = geometry.pin_memory().to(device, non_blocking=True)
        layout = layout.pin_memory().to(device, non_blocking=True)
    # enough taps for the widest filter of the batch: a footprint of 2 x reach pixels
    reach = (boxes[:, 2:] / size).clamp(min=1.0).amax(dim=0).tolist()
    taps_y, taps_x = (math.ceil(2 * r) + 1 for r in reach)
    out = torch.empty(n, channels, size, size, device=device)
    grid = (n, channels, triton.cdiv(size * size, _BLOCK))
    # Triton launches on the current device, which need not be the images' one
    on_their_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_their_device:
        _resample[grid](layout, geometry, out, taps_y, taps_x, FIELDS=_FIELDS, LAYOUT=_LAYOUT, SIZE=size,
                        BLOCK=_BLOCK)
    return out


if triton is not None:
    @triton.jit
    def _tap(pixel, centre, reach, extent):
        """PIL's triangle filter, widened by ``reach`` when downscaling; 0 off the image."""
        weight = tl.maximum(1.0 - tl.abs(pixel.to(tl.float32) + 0.5 - centre) / reach, 0.0)
        return tl.where((pixel >= 0) & (pixel < extent), weight, 0.0)

    @triton.jit
    def _resample(image_layout, geometry, out, taps_y, taps_x, FIELDS: tl.constexpr, LAYOUT: tl.constexpr,
                  SIZE: tl.constexpr, BLOCK: tl.constexpr):
        n = tl.program_id(0)
        channel = tl.program_id(1)
        index = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        inside = index < SIZE * SIZE
        row = geometry + n * FIELDS
        height = tl.load(row).to(tl.int32)
        width = tl.load(row + 1).to(tl.int32)
        top, left = tl.load(row + 2), tl.load(row + 3)
        box_h, box_w = tl.load(row + 4), tl.load(row + 5)
        flipped = tl.load(row + 6) > 0.5
        strides = image_layout + n * LAYOUT
        row_stride, column_stride = tl.load(strides + 2), tl.load(strides + 3)
        image = tl.load(strides).to(tl.pointer_type(tl.uint8)) + channel * tl.load(strides + 1)

        out_y = index // SIZE
        out_x = index % SIZE
        out_x = tl.where(flipped, SIZE - 1 - out_x, out_x)
        step_y, step_x = box_h / SIZE, box_w / SIZE
        reach_y, reach_x = tl.maximum(step_y, 1.0), tl.maximum(step_x, 1.0)
        centre_y = top + (out_y.to(tl.float32) + 0.5) * step_y
        centre_x = left + (out_x.to(tl.float32) + 0.5) * step_x
        # the first pixel whose centre lies inside the filter's open support
        first_y = tl.floor(centre_y - reach_y - 0.5).to(tl.int32) + 1
        first_x = tl.floor(centre_x - reach_x - 0.5).to(tl.int32) + 1

        total_y = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(taps_y):
            total_y += _tap(first_y + k, centre_y, reach_y, height)
        total_x = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(taps_x):
            total_x += _tap(first_x + k, centre_x, reach_x, width)

        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for ky in range(taps_y):
            pixel_y = first_y + ky
            weight_y = _tap(pixel_y, centre_y, reach_y, height)
            row_start = image + pixel_y.to(tl.int64) * row_stride
            for kx in range(taps_x):
                pixel_x = first_x + kx
                weight = weight_y * _tap(pixel_x, centre_x, reach_x, width)
                value = tl.load(row_start + pixel_x.to(tl.int64) * column_stride, mask=inside & (weight > 0.0),
                                other=0)
                acc += weight * value.to(tl.float32)
        result = acc / tl.maximum(total_y * total_x, 1e-12)
        tl.store(out + (n * tl.num_programs(1) + channel) * SIZE * SIZE + index, result, mask=inside)
