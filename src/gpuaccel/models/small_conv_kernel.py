"""activation(conv2d(x, weight, bias)) for a convolution with few input channels (stride 1, no
padding), forward only, as one Triton kernel: FastNet's frozen whitening layer and its GELU (or
tanh-approximated GELU, or SiLU: :data:`ACTIVATIONS`).

Why: cuDNN has no tensor-core kernel for 3 input channels. In cifar10-fast's compiled step on an
H200 (batch 1536, about 4.3 ms) its convolution and the GELU's pass took about 0.26 ms, and
inductor's kernel for the products written out as one sum as long; this kernel takes about half
that (still well above the ~0.03 ms a pass over its 80 MB would take). Each program computes all
the channels of a block of output pixels and writes them channels-last, as the next convolution
reads them.

Needs Triton; with ``TRITON_INTERPRET=1`` set before import, the kernel runs on CPU tensors
through Triton's interpreter (how the tests check it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..triton_support import runs_on, tl, triton

LARGEST_TERMS = 64  # input channels x kernel area: the products per output are unrolled
MOST_CHANNELS = 64  # output channels: a program holds all of them for its pixels
BLOCK_PIXELS, NUM_WARPS = 128, 4
ACTIVATIONS = ("gelu", "gelu_tanh", "silu")  # F.gelu, F.gelu(approximate="tanh"), F.silu


def usable(x: Tensor, weight: Tensor, activation: str = "gelu") -> bool:
    """Whether the kernel computes this convolution here (compiled on a GPU, or interpreted)."""
    out_ch, in_ch, kh, kw = weight.shape
    return activation in ACTIVATIONS and x.dim() == 4 and runs_on(x) \
        and kh == kw and in_ch * kh * kw <= LARGEST_TERMS and out_ch <= MOST_CHANNELS and min(x.shape[-2:]) >= kh \
        and max(x.numel(), len(x) * out_ch * x.shape[-2] * x.shape[-1]) < 2 ** 31  # (offsets in int32)


if triton is not None:
    @triton.jit
    def _conv_activation_kernel(x_ptr, w_ptr, b_ptr, out_ptr, pixels, out_h, out_w, x_sn, x_sc, x_sh, x_sw,
                                IN_CH: tl.constexpr, OUT_CH: tl.constexpr, KERNEL: tl.constexpr,
                                ACTIVATION: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_O: tl.constexpr):
        # output pixels (n, i, j), in int32: int64 divisions are emulated (the kernel took a sixth longer)
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        n, i, j = p // (out_h * out_w), (p // out_w) % out_h, p % out_w
        o = tl.arange(0, BLOCK_O)
        p_ok, o_ok = p < pixels, o < OUT_CH
        acc = tl.zeros([BLOCK_P, BLOCK_O], tl.float32) + tl.load(b_ptr + o, mask=o_ok, other=0.0)[None, :]
        corner = x_ptr + n * x_sn + i * x_sh + j * x_sw
        for c in tl.static_range(IN_CH):
            for dy in tl.static_range(KERNEL):
                for dx in tl.static_range(KERNEL):
                    xv = tl.load(corner + c * x_sc + dy * x_sh + dx * x_sw, mask=p_ok, other=0.0)
                    wv = tl.load(w_ptr + o * (IN_CH * KERNEL * KERNEL) + (c * KERNEL + dy) * KERNEL + dx, mask=o_ok,
                                 other=0.0)
                    acc += xv.to(tl.float32)[:, None] * wv.to(tl.float32)[None, :]
        if ACTIVATION == "gelu":  # exact, F.gelu's default
            y = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
        elif ACTIVATION == "gelu_tanh":  # (tanh(u) = 2 sigmoid(2u) - 1)
            y = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))
        else:  # silu
            y = acc * tl.sigmoid(acc)
        out = out_ptr + p[:, None] * OUT_CH + o[None, :]  # channels-last (N, H, W, C): pixel after pixel
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=p_ok[:, None] & o_ok[None, :])


def _output(x: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
    n, _, h, w = x.shape
    out_ch, _, k, _ = weight.shape
    return torch.empty((n, out_ch, h - k + 1, w - k + 1), dtype=dtype, device=x.device,
                       memory_format=torch.channels_last)


@torch.library.custom_op("gpuaccel::small_conv_activation", mutates_args=())
def small_conv_activation(x: Tensor, weight: Tensor, bias: Tensor, activation: str, dtype: torch.dtype) -> Tensor:
    """activation(conv2d(x, weight, bias)) in ``dtype``, channels-last; no gradient (see :func:`usable`)."""
    out = _output(x, weight, dtype)
    n, out_ch, out_h, out_w = out.shape
    if out.numel():
        weight = weight.contiguous()
        pixels = n * out_h * out_w
        _conv_activation_kernel[(triton.cdiv(pixels, BLOCK_PIXELS),)](
            x, weight, bias, out, pixels, out_h, out_w, *x.stride(), IN_CH=weight.shape[1], OUT_CH=out_ch,
            KERNEL=weight.shape[-1], ACTIVATION=activation, BLOCK_P=BLOCK_PIXELS,
            BLOCK_O=triton.next_power_of_2(out_ch), num_warps=NUM_WARPS)
    return out


@small_conv_activation.register_fake
def _(x, weight, bias, activation, dtype):
    return _output(x, weight, dtype)
