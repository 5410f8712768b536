"""A language model's output layer and its cross-entropy as one operator, for training on a GPU.

Why: compiled, GPT-2 small's loss took 1.6 ms of a 29.3 ms step (docs/results.md, "GPT-2 size"):
a pass over the logits for their log-sum-exp, a second pass (a reduction again) for the gradient,
and a copy of that gradient into the padded vocabulary's width (the slice's backward). Here the
output layer's matrix product is followed by one Triton kernel that writes each row's loss and the
gradient of the mean loss with respect to the row's logits (reading the row twice, the second time
mostly from L2): the backward pass is then the output layer's two matrix products, scaled by the
incoming gradient. Columns at or past ``vocab`` (the padding of the embedding's rows) stay out of
the softmax and get a zero gradient, so the logits are never sliced.

With ``fp8`` (GPT's ``head_fp8``) the three products take FP8 operands (as modded-nanogpt's output
layer does): the hidden states and the weight in E4M3, each with one scale from its largest
magnitude (two kernels: :func:`to_e4m3`), and the logits' gradient in E5M2 with a fixed scale,
written by the same row kernel, then copied transposed, since an FP8 product reduces along both
operands' contiguous dimension. On an H200, GPT-2 small's layer and loss took 5.76 ms instead of
7.20 at 50,304 tokens, its gradients 2.7% from float32's (bf16's 0.23%), and its training reached
bf16's validation loss after 300 steps, within the spread of repeated runs (docs/results.md).

The same loss as ``F.cross_entropy(logits[..., :vocab].float(), targets)`` (targets of -100
ignored, the mean over the others); the gradient of the logits is rounded to their dtype, as
autocast's is. Needs Triton; with ``TRITON_INTERPRET=1`` set before import, the kernel runs on
CPU tensors through Triton's interpreter (how the tests check it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..triton_support import runs_on, tl, triton

IGNORE_INDEX = -100  # F.cross_entropy's default
# Columns a program reads at once. On an H200, for 16,384 rows of 20,352 / 50,304 bf16 logits, the
# kernel alone took 0.57 / 1.50 ms in blocks of 4,096 (8 warps), 0.58 / 1.44 ms in blocks of 2,048,
# 1.14 / 2.58 ms in blocks of 8,192, and 1.07 / 2.11 ms holding a whole row (32,768 columns, 32 warps)
# (benchmarks/gpt2_speed/results/loss_kernel_h200.json)
LARGEST_BLOCK = 4096
# Smaller vocabularies keep PyTorch's loss: the operator saves hundredths of a millisecond a step there
# (0.025 ms at 512 tokens: loss_kernel_h200.json), too little to show against shakespeare-char's steps
# to its target, which moved between 900 and 1,050 from run to run with either loss
# (shakespeare_char_loss_operator_h200.json)
FUSED_FROM_VOCAB = 1024
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# The FP8 gradient holds (softmax - one-hot) x GRAD_SCALE, magnitudes up to 1 x 2^15 (E5M2's largest is
# 57,344): probabilities down to 2^-29 keep E5M2's full precision, and no pass over the gradient finds its scale
GRAD_SCALE = 2.0 ** 15
# The FP8 path's kernels: each row's loss and FP8 gradient in blocks of 1,024 columns (4 warps), then the
# gradient's transpose in tiles of 64 rows x 128 columns (4 warps), where a tiled kernel had written both
# layouts after a kernel for each row's log-sum-exp: GPT-2 small's recipe trained at 1.025x the tokens/s
# with these and the FP8 casts' kernels (benchmarks/gpt2_speed/results/gpt2_speed_code_loss_casts_h200.json);
# loss_kernel.py times other settings
FP8_ROW_SETTINGS, FP8_TRANSPOSE_TILE = (1024, 4), (64, 128, 4)
CAST_BLOCK = 4096  # elements a program casts to FP8


def usable(x: Tensor) -> bool:
    """Whether the kernel can run on ``x`` here (compiled on a GPU, or interpreted)."""
    return runs_on(x)


if triton is not None:
    @triton.jit
    def _row_loss(logits_ptr, targets_ptr, losses_ptr, row, vocab, IGNORE: tl.constexpr, BLOCK: tl.constexpr,
                  VOCAB_BLOCKS: tl.constexpr):
        """Stores row ``row``'s loss: the log-sum-exp of its first ``vocab`` columns (an online
        softmax: a running maximum and sum, block by block) less its target's logit (0 where the
        target is ignored); returns (the log-sum-exp, the target, whether it is kept). (The loop's
        length is a constant: Triton 3.6's interpreter cannot loop to a run-time bound.)"""
        target = tl.load(targets_ptr + row).to(tl.int32)
        kept = target != IGNORE
        running_max = float("-inf")
        running_sum = 0.0
        for i in range(VOCAB_BLOCKS):
            cols = i * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(logits_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, 0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
            running_max = new_max
        log_sum_exp = running_max + tl.log(running_sum)
        target_logit = tl.load(logits_ptr + target, mask=kept, other=0.0).to(tl.float32)
        tl.store(losses_ptr + row, tl.where(kept, log_sum_exp - target_logit, 0.0))
        return log_sum_exp, target, kept

    @triton.jit
    def _loss_and_gradient_kernel(logits_ptr, targets_ptr, count_ptr, losses_ptr, grad_ptr, vocab, width,
                                  logits_stride, grad_stride, IGNORE: tl.constexpr, BLOCK: tl.constexpr,
                                  VOCAB_BLOCKS: tl.constexpr, WIDTH_BLOCKS: tl.constexpr, GRAD_SCALE: tl.constexpr):
        """One row: its loss, then, reading the row again (partly from L2), softmax - one-hot over
        ``count`` (or times ``GRAD_SCALE``, where it is not 0) into every one of the ``width``
        columns of the gradient, in the gradient's dtype."""
        row = tl.program_id(0).to(tl.int64)
        logits_ptr += row * logits_stride
        grad_ptr += row * grad_stride
        log_sum_exp, target, kept = _row_loss(logits_ptr, targets_ptr, losses_ptr, row, vocab, IGNORE, BLOCK,
                                              VOCAB_BLOCKS)
        if GRAD_SCALE > 0:  # (a comparison: compiled Triton takes no float as a condition)
            scale = tl.where(kept, GRAD_SCALE, 0.0)
        else:
            scale = tl.where(kept, 1.0 / tl.load(count_ptr).to(tl.float32), 0.0)
        for i in range(WIDTH_BLOCKS):
            cols = i * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(logits_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            p = tl.exp(x - log_sum_exp)
            g = tl.where(cols == target, p - 1.0, p) * scale
            tl.store(grad_ptr + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < width)

    @triton.jit
    def _fp8_gradient_transpose_kernel(grad_ptr, grad_t_ptr, rows, width, ROWS: tl.constexpr, COLS: tl.constexpr):
        """One tile of ``ROWS`` x ``COLS`` of the (rows, width) gradient, into its transpose."""
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        c = tl.program_id(1).to(tl.int64) * COLS + tl.arange(0, COLS)
        inside = (r[:, None] < rows) & (c[None, :] < width)
        tile = tl.load(grad_ptr + r[:, None] * width + c[None, :], mask=inside)
        tl.store(grad_t_ptr + c[None, :] * rows + r[:, None], tile, mask=inside)

    @triton.jit
    def _largest_magnitude_kernel(x_ptr, largest_ptr, size, BLOCK: tl.constexpr):
        """The largest magnitude in ``x``: each block's, into ``largest`` (float32, zeroed)."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < size, other=0.0).to(tl.float32)
        tl.atomic_max(largest_ptr, tl.max(tl.abs(x), 0))

    @triton.jit
    def _to_e4m3_kernel(x_ptr, largest_ptr, out_ptr, scale_ptr, size, E4M3_MAX: tl.constexpr, BLOCK: tl.constexpr):
        """``x`` over its scale (the largest magnitude over E4M3's largest, float32) in E4M3, the
        values of PyTorch's operations in :func:`to_e4m3`: the scale times the reciprocal (as
        PyTorch divides by a number), the quotient of ``x`` and the scale rounded to ``x``'s dtype
        (as PyTorch divides a bf16 tensor by a float32 one), then to E4M3. The first block also
        stores the scale."""
        scale = tl.maximum(tl.load(largest_ptr), 1e-12) * (1.0 / E4M3_MAX)
        if tl.program_id(0) == 0:
            tl.store(scale_ptr, scale)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < size, other=0.0)
        quotient = tl.div_rn(x.to(tl.float32), scale.to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
        tl.store(out_ptr + i, quotient.to(out_ptr.dtype.element_ty), mask=i < size)


def kernel_settings(width: int) -> tuple[int, int]:
    """(columns per block, warps per row) for rows of ``width`` columns."""
    block = min(LARGEST_BLOCK, triton.next_power_of_2(width))
    return block, max(1, min(8, block // 512))


def loss_and_gradient(logits: Tensor, targets: Tensor, vocab: int,
                      settings: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """(the mean cross-entropy of (N, width) ``logits`` over their first ``vocab`` columns,
    float32; its gradient with respect to the logits, in their dtype), by the kernel
    (``settings``: :func:`kernel_settings`' by default)."""
    rows, width = logits.shape
    losses = torch.empty(rows, device=logits.device, dtype=torch.float32)
    grad = torch.empty_like(logits)
    count = (targets != IGNORE_INDEX).sum()
    if rows:
        block, warps = settings or kernel_settings(width)
        _loss_and_gradient_kernel[(rows,)](logits, targets, count, losses, grad, vocab, width, logits.stride(0),
                                           grad.stride(0), IGNORE=IGNORE_INDEX, BLOCK=block,
                                           VOCAB_BLOCKS=triton.cdiv(vocab, block),
                                           WIDTH_BLOCKS=triton.cdiv(width, block), GRAD_SCALE=0.0, num_warps=warps)
    return losses.sum() / count, grad


def loss_and_fp8_gradient(logits: Tensor, targets: Tensor, vocab: int, settings: tuple[int, int] = FP8_ROW_SETTINGS,
                          transpose_tile: tuple[int, int, int] = FP8_TRANSPOSE_TILE
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(the mean cross-entropy as :func:`loss_and_gradient`'s; (softmax - one-hot) x ``GRAD_SCALE``
    in E5M2, as the logits lie and transposed; the count of targets kept): the gradient of the mean
    loss is the FP8 one over (``GRAD_SCALE`` x count). Two kernels: :func:`loss_and_gradient`'s,
    per row (``settings``: columns per block, warps), then a transposing copy of its gradient in
    tiles (``transpose_tile``: rows, columns, warps)."""
    rows, width = logits.shape
    losses = torch.empty(rows, device=logits.device, dtype=torch.float32)
    grad = torch.empty((rows, width), device=logits.device, dtype=E5M2)
    grad_t = torch.empty((width, rows), device=logits.device, dtype=E5M2)
    count = (targets != IGNORE_INDEX).sum()
    if rows:
        block, warps = settings
        _loss_and_gradient_kernel[(rows,)](logits, targets, count, losses, grad, vocab, width, logits.stride(0),
                                           width, IGNORE=IGNORE_INDEX, BLOCK=block,
                                           VOCAB_BLOCKS=triton.cdiv(vocab, block),
                                           WIDTH_BLOCKS=triton.cdiv(width, block), GRAD_SCALE=GRAD_SCALE,
                                           num_warps=warps)
        tile_rows, tile_cols, tile_warps = transpose_tile
        # (copied as bytes: nothing to convert)
        _fp8_gradient_transpose_kernel[(triton.cdiv(rows, tile_rows), triton.cdiv(width, tile_cols))](
            grad.view(torch.uint8), grad_t.view(torch.uint8), rows, width, ROWS=tile_rows, COLS=tile_cols,
            num_warps=tile_warps)
    return losses.sum() / count, grad, grad_t, count


def to_e4m3(t: Tensor) -> tuple[Tensor, Tensor]:
    """(``t`` scaled so that its largest magnitude is E4M3's largest, in E4M3; the float32 scale
    back): one scale for the tensor. On a GPU by two kernels, a pass for the largest magnitude and
    one for the quotients, with the same values as PyTorch's operations, which take five passes
    (a mixed-dtype division among them): for GPT-2 small's output layer on an H200, 0.35 ms of a
    29 ms step (benchmarks/gpt2_speed/results/gpt2_kernels_code_h200.json)."""
    t = t.detach()
    if not t.is_cuda or triton is None:
        scale = t.abs().amax().float().clamp(min=1e-12) / torch.finfo(E4M3).max
        return (t / scale).to(E4M3), scale
    t = t.contiguous()
    largest = torch.zeros((), device=t.device, dtype=torch.float32)
    scale = torch.empty((), device=t.device, dtype=torch.float32)
    out = torch.empty(t.shape, device=t.device, dtype=E4M3)
    grid = (triton.cdiv(t.numel(), CAST_BLOCK),)
    _largest_magnitude_kernel[grid](t, largest, t.numel(), BLOCK=CAST_BLOCK)
    _to_e4m3_kernel[grid](t, largest, out, scale, t.numel(), E4M3_MAX=torch.finfo(E4M3).max, BLOCK=CAST_BLOCK)
    return out, scale


def column_major(t: Tensor) -> Tensor:
    """``t`` with the same values laid out by columns: ``torch._scaled_mm``'s second operand."""
    return t.t().contiguous().t()


@torch.library.custom_op("gpuaccel::linear_cross_entropy_fp8", mutates_args=())
def _linear_cross_entropy_fp8(hidden: Tensor, weight: Tensor, targets: Tensor,
                              vocab: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(mean loss; for the backward pass: the FP8 gradient of the logits, as they lie and
    transposed; the kept targets' count; ``hidden`` and ``weight`` in E4M3 and their scales): the
    logits are the product of ``hidden`` and ``weight`` in E4M3, in ``hidden``'s dtype."""
    hidden8, hidden_scale = to_e4m3(hidden)
    weight8, weight_scale = to_e4m3(weight)
    logits = torch._scaled_mm(hidden8, weight8.T, scale_a=hidden_scale, scale_b=weight_scale, out_dtype=hidden.dtype)
    loss, grad, grad_t, count = loss_and_fp8_gradient(logits, targets, vocab)
    return loss, grad, grad_t, count, hidden8, hidden_scale, weight8, weight_scale


@_linear_cross_entropy_fp8.register_fake
def _(hidden, weight, targets, vocab):
    (rows, _), width = hidden.shape, weight.shape[0]
    scalar = hidden.new_empty((), dtype=torch.float32)
    return (scalar, hidden.new_empty((rows, width), dtype=E5M2), hidden.new_empty((width, rows), dtype=E5M2),
            hidden.new_empty((), dtype=torch.int64), hidden.new_empty(hidden.shape, dtype=E4M3), scalar.clone(),
            weight.new_empty(weight.shape, dtype=E4M3), scalar.clone())


def _setup_context_fp8(ctx, inputs, output):
    ctx.dtypes = inputs[0].dtype, inputs[1].dtype
    ctx.save_for_backward(*output[1:])


def _backward_fp8(ctx, grad_loss, *_):
    """The two products of the backward pass in FP8: the logits' gradient (E5M2) by the weight
    (E4M3), and its transpose by the hidden states (E4M3)."""
    grad, grad_t, count, hidden8, hidden_scale, weight8, weight_scale = ctx.saved_tensors
    grad_scale = grad_loss.float() / (count * GRAD_SCALE)
    hidden_dtype, weight_dtype = ctx.dtypes
    grad_hidden = torch._scaled_mm(grad, column_major(weight8), scale_a=grad_scale, scale_b=weight_scale,
                                   out_dtype=hidden_dtype)
    grad_weight = torch._scaled_mm(grad_t, column_major(hidden8), scale_a=grad_scale, scale_b=hidden_scale,
                                   out_dtype=weight_dtype)
    return grad_hidden, grad_weight, None, None


_linear_cross_entropy_fp8.register_autograd(_backward_fp8, setup_context=_setup_context_fp8)


@torch.library.custom_op("gpuaccel::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """(mean loss, its gradient with respect to the logits ``hidden @ weight.T``): the logits
    live only inside the operator."""
    return loss_and_gradient(hidden @ weight.T, targets, vocab)


@_linear_cross_entropy.register_fake
def _(hidden, weight, targets, vocab):
    return hidden.new_empty((), dtype=torch.float32), hidden.new_empty((hidden.shape[0], weight.shape[0]))


def _setup_context(ctx, inputs, output):
    hidden, weight, _, _ = inputs
    ctx.save_for_backward(hidden, weight, output[1])


def _backward(ctx, grad_loss, _grad_of_gradient):
    hidden, weight, grad_logits = ctx.saved_tensors
    grad_hidden = (grad_logits @ weight).float().mul_(grad_loss).to(hidden.dtype)
    grad_weight = (grad_logits.T @ hidden).float().mul_(grad_loss).to(weight.dtype)
    return grad_hidden, grad_weight, None, None


_linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, vocab: int, fp8: bool = False) -> Tensor:
    """``F.cross_entropy((hidden @ weight.T)[..., :vocab].float(), targets)`` over (..., C) ``hidden``
    and (rows >= vocab, C) ``weight``, in autocast's dtype where it is on: by the operator where
    the kernel can run (:func:`usable`) and the vocabulary has ``FUSED_FROM_VOCAB`` tokens or more,
    else as written. (Replayed from a CUDA graph on an H200, the operator's forward and backward
    passes took 0.68-0.88x compiled PyTorch's time from 65 to 20,352 tokens, 0.56x at 50,304:
    loss_kernel_h200.json.) ``fp8``: the operator's three products in FP8 (:func:`fp8_usable`).
    Targets must be below ``vocab`` or -100 (the operator does not check)."""
    hidden, targets = hidden.flatten(0, -2), targets.flatten()
    if usable(hidden) and vocab >= FUSED_FROM_VOCAB:
        return fused_linear_cross_entropy(hidden, weight, targets, vocab, fp8)
    return pytorch_linear_cross_entropy(hidden, weight, targets, vocab)


def pytorch_linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, vocab: int) -> Tensor:
    """:func:`linear_cross_entropy` of (N, C) ``hidden`` and (N,) ``targets`` as PyTorch's
    operations: the logits, the vocabulary's slice of them, float32 ``F.cross_entropy``."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy((logits if logits.shape[-1] == vocab else logits[:, :vocab]).float(), targets)


def fp8_usable(hidden: Tensor, weight: Tensor) -> bool:
    """Whether the FP8 products take (N, C) ``hidden`` and (rows, C) ``weight``: FP8 products need
    each dimension a multiple of 16. (The GPU's support is the caller's to check: FP8 products
    need compute capability 8.9 or later.)"""
    return not (hidden.shape[0] % 16 or hidden.shape[1] % 16 or weight.shape[0] % 16)


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, vocab: int,
                               fp8: bool = False) -> Tensor:
    """:func:`linear_cross_entropy` of (N, C) ``hidden`` and (N,) ``targets`` by the operator (its
    FP8 products with ``fp8``, where :func:`fp8_usable`; in the autocast dtype otherwise)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    if fp8 and fp8_usable(hidden, weight):
        return _linear_cross_entropy_fp8(hidden, weight, targets, vocab)[0]
    return _linear_cross_entropy(hidden, weight, targets, vocab)[0]
