"""The resampler of :mod:`crops` as one Triton kernel, for images on a GPU.

Why a kernel: the matrix-product resampler first packs each image's window into a padded
canvas, and that costs host time per image (a view, a padding kernel through nested
tensors): milliseconds of host time per batch, on the thread that must also call the JPEG
decoder. Here each decoded image stays where nvJPEG left it; the kernel
finds it through a table of pointers and computes PIL's triangle-filter taps itself, so a
batch is one launch and the host builds a table of one row per image. The table holds
each image's strides too, so an image decoded on the CPU (height, width, channel order,
or one grey channel read three times) is read where it was uploaded, without a copy.

Output pixel (y, x) of image n is the sum over taps_y x taps_x source pixels of the
product of the row and column taps, divided by their sums (as PIL normalises each
axis), in fp32. A flipped output column reads the taps of its mirror column. The tap
counts are each image's own (its box's downscaling factor), not the batch's widest: a
random-resized crop spans 8-100% of the image, so most of a batch needs far fewer taps
than its largest box.

One program makes a block of output pixels in every channel: a tap's weight is computed
once for all channels, and a row's column taps once for all rows (they are held as a
block of up to ``_TAP_BLOCK`` taps; wider filters take several). It can also finish the
batch for training in the same pass: a per-channel scale and shift (the normalisation),
the output's dtype and memory layout (bf16 channels_last), so no further kernels read the
batch again.

Needs Triton (it comes with PyTorch's CUDA wheels). With ``TRITON_INTERPRET=1`` set before
this module is imported, the same kernel runs on CPU tensors through Triton's interpreter:
that is how the tests check it on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..triton_support import INTERPRETED as _INTERPRETED
from ..triton_support import tl, triton

# output pixels per program; the interpreter runs programs one by one, so it gets big ones
_BLOCK = 4096 if _INTERPRETED else 128
_WARPS = 4
_TAP_BLOCK = 4  # column taps held at once (a power of two)
_FIELDS = 7  # per image: height, width, box top, left, height, width, flip (float32)
_LAYOUT = 4  # per image: address, channel stride, row stride, column stride (int64, in elements)
# (a kernel argument must not be called "params": Triton 3.6's argument binder uses that name)


def usable(device: torch.device) -> bool:
    """Whether the kernel runs compiled on ``device`` (interpreted runs are for tests)."""
    return triton is not None and device.type == "cuda"


def resample_layout(layout, sizes, channels: int, device: torch.device, boxes: torch.Tensor, size: int,
                    flip: torch.Tensor | None = None, affine: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32, channels_last: bool = False) -> torch.Tensor:
    """The contract of :func:`gpuaccel.data.crops.resample_boxes`, for images given by
    ``layout`` ((N, 4) int64: address, channel, row and column stride, as
    :meth:`crops.ImageTable.addresses` makes it) and ``sizes`` ((N, 2): height, width):
    (N, channels, size, size) in 0..255, or ``value * affine[0, c] + affine[1, c]`` with
    ``affine`` ((2, channels) float32 on ``device``), in ``dtype`` and, with
    ``channels_last``, that memory format. The caller keeps the images alive."""
    n = len(sizes)
    if not (usable(device) or (triton is not None and _INTERPRETED)):
        raise RuntimeError(f"the Triton resampler cannot run on {device} here")
    if affine is not None and affine.shape != (2, channels):
        raise ValueError(f"affine must be (2, {channels}), got {tuple(affine.shape)}")
    boxes = boxes.detach().to("cpu", torch.float32)
    flip = torch.zeros(n) if flip is None else flip.to("cpu", torch.float32)
    geometry = torch.cat([torch.as_tensor(sizes, dtype=torch.float32), boxes, flip[:, None]], dim=1)
    layout = torch.as_tensor(layout, dtype=torch.int64)
    if device.type == "cuda":
        geometry = geometry.pin_memory().to(device, non_blocking=True)
        layout = layout.pin_memory().to(device, non_blocking=True)
    # the column tile fits the widest filter of the batch (a footprint of 2 x reach pixels)
    # up to _TAP_BLOCK; each image loops over its own taps
    widest_x = math.ceil(2 * (boxes[:, 3] / size).clamp(min=1.0).max().item()) + 1
    out = torch.empty(n, channels, size, size, device=device, dtype=dtype,
                      memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    grid = (n, triton.cdiv(size * size, _BLOCK))
    # Triton launches on the current device, which need not be the images' one
    on_their_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_their_device:
        _resample[grid](layout, geometry, out, out if affine is None else affine, out.stride(0), out.stride(1),
                        out.stride(3), CHANNELS=channels,
                        CHANNEL_BLOCK=triton.next_power_of_2(channels), AFFINE=affine is not None,
                        FIELDS=_FIELDS, LAYOUT=_LAYOUT, SIZE=size, BLOCK=_BLOCK,
                        TAPS=min(_TAP_BLOCK, triton.next_power_of_2(widest_x)), num_warps=_WARPS)
    return out


if triton is not None:
    @triton.jit
    def _tap(pixel, centre, reach, extent):
        """PIL's triangle filter, widened by ``reach`` when downscaling; 0 off the image."""
        weight = tl.maximum(1.0 - tl.abs(pixel.to(tl.float32) + 0.5 - centre) / reach, 0.0)
        return tl.where((pixel >= 0) & (pixel < extent), weight, 0.0)

    @triton.jit
    def _resample(image_layout, geometry, out, affine, out_image_stride, out_channel_stride,
                  out_pixel_stride, CHANNELS: tl.constexpr, CHANNEL_BLOCK: tl.constexpr, AFFINE: tl.constexpr,
                  FIELDS: tl.constexpr, LAYOUT: tl.constexpr, SIZE: tl.constexpr, BLOCK: tl.constexpr,
                  TAPS: tl.constexpr):
        n = tl.program_id(0)
        index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = index < SIZE * SIZE
        channel = tl.arange(0, CHANNEL_BLOCK)
        real_channel = channel < CHANNELS
        row = geometry + n * FIELDS
        height = tl.load(row).to(tl.int32)
        width = tl.load(row + 1).to(tl.int32)
        top, left = tl.load(row + 2), tl.load(row + 3)
        box_h, box_w = tl.load(row + 4), tl.load(row + 5)
        flipped = tl.load(row + 6) > 0.5
        strides = image_layout + n * LAYOUT
        row_stride, column_stride = tl.load(strides + 2), tl.load(strides + 3)
        image = tl.load(strides).to(tl.pointer_type(tl.uint8))
        channel_offset = channel.to(tl.int64) * tl.load(strides + 1)

        out_y = index // SIZE
        out_x = index % SIZE
        out_x = tl.where(flipped, SIZE - 1 - out_x, out_x)
        step_y, step_x = box_h / SIZE, box_w / SIZE
        reach_y, reach_x = tl.maximum(step_y, 1.0), tl.maximum(step_x, 1.0)
        # this image's taps: the pixels a footprint of 2 x reach can cover
        taps_y = tl.ceil(2.0 * reach_y).to(tl.int32) + 1
        taps_x = tl.ceil(2.0 * reach_x).to(tl.int32) + 1
        centre_y = top + (out_y.to(tl.float32) + 0.5) * step_y
        centre_x = left + (out_x.to(tl.float32) + 0.5) * step_x
        # the first pixel whose centre lies inside the filter's open support
        first_y = tl.floor(centre_y - reach_y - 0.5).to(tl.int32) + 1
        first_x = tl.floor(centre_x - reach_x - 0.5).to(tl.int32) + 1

        total_y = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(taps_y):
            total_y += _tap(first_y + k, centre_y, reach_y, height)

        total_x = tl.zeros([BLOCK], dtype=tl.float32)
        acc = tl.zeros([BLOCK, CHANNEL_BLOCK], dtype=tl.float32)
        for x0 in range(0, taps_x, TAPS):
            pixel_x = first_x[:, None] + x0 + tl.arange(0, TAPS)[None, :]
            weight_x = _tap(pixel_x, centre_x[:, None], reach_x, width)  # taps past the support weigh 0
            total_x += tl.sum(weight_x, axis=1)
            columns = pixel_x.to(tl.int64) * column_stride
            use_x = (weight_x > 0.0)[:, :, None] & real_channel[None, None, :] & inside[:, None, None]
            for ky in range(taps_y):
                pixel_y = first_y + ky
                weight_y = _tap(pixel_y, centre_y, reach_y, height)
                start = image + pixel_y.to(tl.int64) * row_stride
                at = start[:, None, None] + columns[:, :, None] + channel_offset[None, None, :]
                value = tl.load(at, mask=use_x & (weight_y > 0.0)[:, None, None], other=0).to(tl.float32)
                acc += weight_y[:, None] * tl.sum(value * weight_x[:, :, None], axis=1)
        result = acc / tl.maximum(total_y * total_x, 1e-12)[:, None]
        if AFFINE:
            result = result * tl.load(affine + channel, mask=real_channel, other=1.0)[None, :] \
                + tl.load(affine + CHANNELS + channel, mask=real_channel, other=0.0)[None, :]
        target = out + n * out_image_stride + index[:, None] * out_pixel_stride + channel[None, :] * out_channel_stride
        tl.store(target, result, mask=inside[:, None] & real_channel[None, :])
