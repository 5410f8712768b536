"""Max pooling over channels-last tensors as two Triton kernels, for training on a GPU.

Why: in a compiled ResNet-50 step, inductor's max-pooling kernels (and ATen's) took many
times what a memory-bound pass over their tensors needs, the backward pass most of it.
Here the forward pass keeps, per output, which element of its window won, as one byte; the
backward pass gives each input element the gradients of the (at most ceil(k/s)^2) windows
that chose it, reading those bytes, and writes each input gradient once, with no atomics.

Same results as ``torch.nn.functional.max_pool2d``: the first maximum in the window's row-major
order wins, NaN wins (a later NaN over an earlier one), and a window of -inf alone picks its
first element inside the image. Needs Triton; with ``TRITON_INTERPRET=1`` set before import,
the kernels run on CPU tensors through Triton's interpreter (how the tests check them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..triton_support import runs_on, tl, triton

_BLOCK_PIXELS = 32  # output (forward) or input (backward) pixels per program, by all channels up to 64
_NUM_WARPS = 4
LARGEST_KERNEL = 11  # a window's winner is stored as int8: at most 127 positions


def usable(x: Tensor) -> bool:
    """Whether the kernels can pool ``x`` here (compiled on a GPU, or interpreted)."""
    return x.dim() == 4 and runs_on(x)


if triton is not None:
    @triton.jit
    def _tile(pixels, channels, rows, cols, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        """This program's pixels (image, row, column) and channels, and which of them exist."""
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        return p // (rows * cols), (p // cols) % rows, p % cols, p < pixels, c, c < channels

    @triton.jit
    def _forward_kernel(x_ptr, out_ptr, win_ptr, pixels, channels, height, width, out_h, out_w,
                        x_sn, x_sc, x_sh, x_sw, o_sn, o_sc, o_sh, o_sw,
                        KERNEL: tl.constexpr, STRIDE: tl.constexpr, PAD: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        n, oh, ow, p_ok, c, c_ok = _tile(pixels, channels, out_h, out_w, BLOCK_P, BLOCK_C)
        best = tl.full([BLOCK_P, BLOCK_C], float("-inf"), tl.float32)
        won = tl.zeros([BLOCK_P, BLOCK_C], tl.int32)
        seen = tl.zeros([BLOCK_P, BLOCK_C], tl.int1)
        for i in tl.static_range(KERNEL):
            h = oh * STRIDE - PAD + i
            for j in tl.static_range(KERNEL):
                w = ow * STRIDE - PAD + j
                inside = p_ok & (h >= 0) & (h < height) & (w >= 0) & (w < width)
                mask = inside[:, None] & c_ok[None, :]
                v = tl.load(x_ptr + (n * x_sn + h * x_sh + w * x_sw)[:, None] + (c * x_sc)[None, :],
                            mask=mask, other=float("-inf")).to(tl.float32)
                take = mask & ((v > best) | (v != v) | (seen == 0))
                best = tl.where(take, v, best)
                won = tl.where(take, i * KERNEL + j, won)
                seen = seen | mask
        out_offset = (n * o_sn + oh * o_sh + ow * o_sw)[:, None] + (c * o_sc)[None, :]
        mask = p_ok[:, None] & c_ok[None, :]
        tl.store(out_ptr + out_offset, best.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(win_ptr + out_offset, won.to(tl.int8), mask=mask)

    @triton.jit
    def _backward_kernel(grad_ptr, win_ptr, gx_ptr, pixels, channels, height, width, out_h, out_w,
                         g_sn, g_sc, g_sh, g_sw, w_sn, w_sc, w_sh, w_sw, x_sn, x_sc, x_sh, x_sw,
                         KERNEL: tl.constexpr, STRIDE: tl.constexpr, PAD: tl.constexpr,
                         BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        n, h, w, p_ok, c, c_ok = _tile(pixels, channels, height, width, BLOCK_P, BLOCK_C)
        SPAN: tl.constexpr = (KERNEL + STRIDE - 1) // STRIDE  # windows per axis that hold an element
        acc = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
        for a in tl.static_range(SPAN):
            oh = (h + PAD) // STRIDE - a
            i = h + PAD - oh * STRIDE
            row_ok = (oh >= 0) & (oh < out_h) & (i < KERNEL)
            for b in tl.static_range(SPAN):
                ow = (w + PAD) // STRIDE - b
                j = w + PAD - ow * STRIDE
                ok = p_ok & row_ok & (ow >= 0) & (ow < out_w) & (j < KERNEL)
                mask = ok[:, None] & c_ok[None, :]
                won = tl.load(win_ptr + (n * w_sn + oh * w_sh + ow * w_sw)[:, None] + (c * w_sc)[None, :],
                              mask=mask, other=-1)
                g = tl.load(grad_ptr + (n * g_sn + oh * g_sh + ow * g_sw)[:, None] + (c * g_sc)[None, :],
                            mask=mask, other=0.0).to(tl.float32)
                acc += tl.where(won.to(tl.int32) == (i * KERNEL + j)[:, None], g, 0.0)
        tl.store(gx_ptr + (n * x_sn + h * x_sh + w * x_sw)[:, None] + (c * x_sc)[None, :],
                 acc.to(gx_ptr.dtype.element_ty), mask=p_ok[:, None] & c_ok[None, :])


def _out_size(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def _is_channels_last(x: Tensor) -> bool:
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def _empty(shape, like: Tensor, channels_last: bool) -> Tensor:
    return torch.empty(shape, dtype=like.dtype, device=like.device,
                       memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _pooled_outputs(x: Tensor, kernel: int, stride: int, padding: int) -> tuple[Tensor, Tensor]:
    """Empty (pooled, winner) tensors for ``x``, in its layout."""
    n, c, h, w = x.shape
    shape = (n, c, _out_size(h, kernel, stride, padding), _out_size(w, kernel, stride, padding))
    out = _empty(shape, x, _is_channels_last(x))
    return out, torch.empty_like(out, dtype=torch.int8)


def _grid(pixels: int, channels: int):
    block_c = min(64, triton.next_power_of_2(channels))
    return (triton.cdiv(pixels, _BLOCK_PIXELS), triton.cdiv(channels, block_c)), block_c


@torch.library.custom_op("gpuaccel::max_pool2d", mutates_args=())
def max_pool2d(x: Tensor, kernel: int, stride: int, padding: int) -> tuple[Tensor, Tensor]:
    """(pooled, winner): winner holds, per output, the row-major position in its window of the
    element that won (int8). As an operator for autograd and torch.compile; without either,
    :func:`pooled` is the same kernel without the operator (whose first call imports Dynamo, 0.8 s
    of an inference command's start)."""
    return pooled(x, kernel, stride, padding)


def pooled(x: Tensor, kernel: int, stride: int, padding: int) -> tuple[Tensor, Tensor]:
    """:func:`max_pool2d`'s kernel, called directly."""
    n, c, h, w = x.shape
    out, winner = _pooled_outputs(x, kernel, stride, padding)
    out_h, out_w = out.shape[2:]
    pixels = n * out_h * out_w
    if pixels and c:
        grid, block_c = _grid(pixels, c)
        _forward_kernel[grid](x, out, winner, pixels, c, h, w, out_h, out_w, *x.stride(), *out.stride(),
                              KERNEL=kernel, STRIDE=stride, PAD=padding, BLOCK_P=_BLOCK_PIXELS, BLOCK_C=block_c,
                              num_warps=_NUM_WARPS)
    return out, winner


@max_pool2d.register_fake
def _(x, kernel, stride, padding):
    return _pooled_outputs(x, kernel, stride, padding)


@torch.library.custom_op("gpuaccel::max_pool2d_backward", mutates_args=())
def max_pool2d_backward(grad: Tensor, winner: Tensor, height: int, width: int, channels_last: bool, kernel: int,
                        stride: int, padding: int) -> Tensor:
    """The gradient of an input of ``height`` x ``width`` pixels (in channels-last layout or not)."""
    n, c = grad.shape[:2]
    grad_input = _empty((n, c, height, width), grad, channels_last)
    pixels = n * height * width
    if pixels and c:
        grid, block_c = _grid(pixels, c)
        _backward_kernel[grid](grad, winner, grad_input, pixels, c, height, width, grad.shape[2], grad.shape[3],
                               *grad.stride(), *winner.stride(), *grad_input.stride(),
                               KERNEL=kernel, STRIDE=stride, PAD=padding, BLOCK_P=_BLOCK_PIXELS, BLOCK_C=block_c,
                               num_warps=_NUM_WARPS)
    return grad_input


@max_pool2d_backward.register_fake
def _(grad, winner, height, width, channels_last, kernel, stride, padding):
    return _empty((grad.shape[0], grad.shape[1], height, width), grad, channels_last)


def _setup_context(ctx, inputs, output):
    x, kernel, stride, padding = inputs
    ctx.save_for_backward(output[1])
    ctx.args = (x.shape[2], x.shape[3], _is_channels_last(x), kernel, stride, padding)


def _backward(ctx, grad, _grad_winner):
    (winner,) = ctx.saved_tensors
    return max_pool2d_backward(grad, winner, *ctx.args), None, None, None


max_pool2d.register_autograd(_backward, setup_context=_setup_context)
