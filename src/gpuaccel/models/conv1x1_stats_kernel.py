"""A 1x1 convolution over a channels-last tensor that also sums each output channel, as one
Triton kernel: the statistics a batch norm needs, taken while the output is still in registers.

Why: in a compiled ResNet-50 step inductor reads every convolution's output once more, only for
its batch norm's statistics (2.7 ms of a 34.5 ms step at 224 px, batch 256, on an H200;
models/conv_bn_stats.py). Most of those outputs come from 1x1 convolutions, which in the
channels-last layout are matrix products: (images x pixels, in channels) @ (in channels, out
channels). cuDNN's own fused statistics ran slower than the pass they save (its generic
runtime-fusion kernels); this kernel is a plain tiled matrix product whose epilogue adds each
tile's column sums and sums of squares into two fp32 vectors with atomics.

The sums are of the output as stored (rounded to its dtype), so a batch norm computed from them
normalises exactly what it reads. Atomics make the order of the additions, and so the last bits
of the sums, vary from run to run. Needs Triton; with ``TRITON_INTERPRET=1`` set before import
the kernel runs on CPU tensors through Triton's interpreter (how the tests check it).
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of PyTorch come without Triton
    triton = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def usable(x: Tensor, weight: Tensor, padding: int) -> bool:
    """Whether the kernel can compute ``conv2d(x, weight, padding=padding)`` here: a 1x1
    kernel without padding, 16-bit floats, compiled on a GPU (or interpreted)."""
    return triton is not None and (x.is_cuda or _INTERPRETED) and x.dim() == 4 \
        and tuple(weight.shape[2:]) == (1, 1) and padding == 0 \
        and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype


if triton is not None:
    def _configs():
        if _INTERPRETED:
            return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4})]
        # (rows, out channels, in channels) per tile, pipeline stages, warps. With 64 input
        # channels (ResNet's first stage) there is one step along them, so fewer stages leave room
        # for more tiles per multiprocessor to overlap one tile's stores with another's loads
        shapes = [(128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 64, 64, 4, 4),
                  (64, 128, 64, 4, 4), (128, 128, 64, 3, 4), (64, 64, 64, 4, 4), (256, 64, 64, 3, 8),
                  (64, 64, 64, 1, 4), (128, 64, 64, 1, 4), (64, 128, 64, 1, 4), (128, 128, 64, 1, 8),
                  (64, 256, 64, 1, 8), (128, 256, 64, 1, 8), (128, 128, 64, 2, 8), (128, 64, 64, 2, 4)]
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s, num_warps=w)
                for m, n, k, s, w in shapes]

    @triton.autotune(configs=_configs(), key=["M", "N", "K", "STRIDE", "STATISTICS"], reset_to_zero=["sum_ptr", "sq_ptr"])
    @triton.heuristics({"EVEN_K": lambda meta: meta["K"] % meta["BLOCK_K"] == 0})
    @triton.jit
    def _conv1x1_stats_kernel(x_ptr, w_ptr, y_ptr, sum_ptr, sq_ptr, M, N, K, in_h, in_w, out_h, out_w,
                              STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                              STATISTICS: tl.constexpr = True):
        # tiles in groups of GROUP_M row blocks, so that neighbouring programs share their input rows in L2
        pid = tl.program_id(0)
        blocks_m, blocks_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * blocks_n)
        first_m = group * GROUP_M
        rows_in_group = tl.minimum(blocks_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * blocks_n)) % rows_in_group
        pid_n = (pid % (GROUP_M * blocks_n)) // rows_in_group

        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # output pixels (image, row, column)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output channels
        k = tl.arange(0, BLOCK_K)  # input channels
        m_ok, n_ok = m < M, n < N
        if STRIDE == 1:
            pixel = m.to(tl.int64)
        else:  # the input pixel under each output pixel
            image, at = m // (out_h * out_w), m % (out_h * out_w)
            pixel = (image * in_h + at // out_w * STRIDE).to(tl.int64) * in_w + at % out_w * STRIDE
        x_ptrs = x_ptr + pixel[:, None] * K + k[None, :]
        w_ptrs = w_ptr + n[None, :].to(tl.int64) * K + k[:, None]  # weight is (out, in): read transposed
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            if EVEN_K:  # (masks along the reduced axis cost the loads their width)
                a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
                b = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = k + start < K
                a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y = acc.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + m.to(tl.int64)[:, None] * N + n[None, :], y, mask=m_ok[:, None] & n_ok[None, :])
        if STATISTICS:  # (off only to time the matrix product alone)
            stored = y.to(tl.float32)  # rows past M are zeros: their inputs loaded as zeros
            tl.atomic_add(sum_ptr + n, tl.sum(stored, axis=0), mask=n_ok)
            tl.atomic_add(sq_ptr + n, tl.sum(stored * stored, axis=0), mask=n_ok)


    def _tensor_blocks(nargs):
        """Each tensor descriptor's block, for the configuration being launched."""
        nargs["x_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
        nargs["w_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]
        nargs["y_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_N"]]

    def _tma_configs():
        shapes = [(128, 128, 64, 3, 8), (128, 256, 64, 3, 8), (128, 64, 64, 3, 4), (64, 128, 64, 3, 4),
                  (128, 128, 64, 4, 4), (64, 64, 64, 3, 4), (128, 256, 64, 4, 8), (256, 128, 64, 3, 8),
                  (128, 64, 64, 2, 4), (128, 128, 64, 2, 8)]
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s, num_warps=w,
                              pre_hook=_tensor_blocks) for m, n, k, s, w in shapes]

    @triton.autotune(configs=_tma_configs(), key=["M", "N", "K", "STATISTICS"], reset_to_zero=["sum_ptr", "sq_ptr"])
    @triton.jit
    def _conv1x1_stats_tma_kernel(x_desc, w_desc, y_desc, sum_ptr, sq_ptr, M, N, K, NUM_SMS: tl.constexpr,
                                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                  GROUP_M: tl.constexpr, STATISTICS: tl.constexpr = True):
        """The stride-1 kernel on Hopper's tensor memory accelerator: one program per
        multiprocessor walks over the tiles, so that one tile's stores overlap the next one's
        loads. Reads past the tensors' edges come back as zeros."""
        blocks_m, blocks_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        in_group = GROUP_M * blocks_n
        for tile in tl.range(tl.program_id(0), blocks_m * blocks_n, NUM_SMS, flatten=True):
            first_m = tile // in_group * GROUP_M
            rows_in_group = tl.minimum(blocks_m - first_m, GROUP_M)
            off_m = (first_m + (tile % in_group) % rows_in_group) * BLOCK_M
            off_n = (tile % in_group) // rows_in_group * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for start in range(0, K, BLOCK_K):
                a = x_desc.load([off_m, start])
                b = w_desc.load([off_n, start])
                acc = tl.dot(a, b.T, acc)
            y = acc.to(y_desc.dtype)
            y_desc.store([off_m, off_n], y)
            if STATISTICS:
                stored = y.to(tl.float32)
                n = off_n + tl.arange(0, BLOCK_N)
                tl.atomic_add(sum_ptr + n, tl.sum(stored, axis=0), mask=n < N)
                tl.atomic_add(sq_ptr + n, tl.sum(stored * stored, axis=0), mask=n < N)


# Whether stride-1 convolutions run on the tensor memory accelerator (where there is one)
USE_TMA = True


def _tma_usable(x: Tensor, stride: int, in_ch: int, out_ch: int) -> bool:
    if not (USE_TMA and stride == 1 and x.is_cuda and not _INTERPRETED
            and torch.cuda.get_device_capability(x.device)[0] >= 9
            and in_ch % 8 == 0 and out_ch % 8 == 0 and x.data_ptr() % 16 == 0):  # (whole 16-byte units)
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401  (Triton 3.3+)
    except ImportError:
        return False
    return True


def conv1x1_stats(x: Tensor, weight: Tensor, stride: int, statistics: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """``y = conv2d(x, weight, stride=stride)`` for a 1x1 ``weight``, channels-last, and the
    fp32 sum and sum of squares of each of ``y``'s channels (zeros with ``statistics`` off,
    which is there to time the matrix product alone)."""
    x = x.contiguous(memory_format=torch.channels_last)
    batch, in_ch, in_h, in_w = x.shape
    out_ch = weight.shape[0]
    out_h, out_w = (in_h - 1) // stride + 1, (in_w - 1) // stride + 1
    y = torch.empty((batch, out_ch, out_h, out_w), dtype=x.dtype, device=x.device,
                    memory_format=torch.channels_last)
    total = torch.zeros(out_ch, dtype=torch.float32, device=x.device)
    squares = torch.zeros(out_ch, dtype=torch.float32, device=x.device)
    pixels = batch * out_h * out_w

    w = weight.reshape(out_ch, in_ch).contiguous()
    if _tma_usable(x, stride, in_ch, out_ch):
        from triton.tools.tensor_descriptor import TensorDescriptor

        def descriptor(t):  # (the block is set per configuration, by _tensor_blocks)
            return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1])
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        try:
            _conv1x1_stats_tma_kernel[lambda meta: (min(sms, triton.cdiv(pixels, meta["BLOCK_M"])
                                                         * triton.cdiv(out_ch, meta["BLOCK_N"])),)](
                descriptor(x.permute(0, 2, 3, 1).reshape(pixels, in_ch)), descriptor(w),
                descriptor(y.permute(0, 2, 3, 1).reshape(pixels, out_ch)), total, squares, pixels, out_ch,
                in_ch, NUM_SMS=sms, STATISTICS=statistics)
            return y, total, squares
        except Exception as error:  # a Triton that cannot build it: the pointer form from now on
            global USE_TMA
            USE_TMA = False
            warnings.warn(f"the 1x1 convolution's TMA kernel did not build ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}); using its pointer form")
            total.zero_()
            squares.zero_()

    def grid(meta):
        return (triton.cdiv(pixels, meta["BLOCK_M"]) * triton.cdiv(out_ch, meta["BLOCK_N"]),)
    _conv1x1_stats_kernel[grid](x, w, y, total, squares, pixels, out_ch, in_ch,
                                in_h, in_w, out_h, out_w, STRIDE=stride, STATISTICS=statistics)
    return y, total, squares
