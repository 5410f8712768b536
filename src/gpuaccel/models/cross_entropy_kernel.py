"""A language model's output layer and its cross-entropy as one operator, for training on a GPU.

Why: compiled, GPT-2 small's loss took 1.6 ms of a 29.3 ms step (docs/results.md, "GPT-2 size"):
a pass over the logits for their log-sum-exp, a second pass (a reduction again) for the gradient,
and a copy of that gradient into the padded vocabulary's width (the slice's backward). Here the
output layer's matrix product is followed by one Triton kernel that writes each row's loss and the
gradient of the mean loss with respect to the row's logits (reading the row twice, the second time
mostly from L2): the backward pass is then the output layer's two matrix products, scaled by the
incoming gradient. Columns at or past ``vocab`` (the padding of the embedding's rows) stay out of
the softmax and get a zero gradient, so the logits are never sliced.

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


def usable(x: Tensor) -> bool:
    """Whether the kernel can run on ``x`` here (compiled on a GPU, or interpreted)."""
    return runs_on(x)


if triton is not None:
    @triton.jit
    def _loss_and_gradient_kernel(logits_ptr, targets_ptr, count_ptr, losses_ptr, grad_ptr, vocab, width,
                                  logits_stride, grad_stride, IGNORE: tl.constexpr, BLOCK: tl.constexpr,
                                  VOCAB_BLOCKS: tl.constexpr, WIDTH_BLOCKS: tl.constexpr):
        """One row: its log-sum-exp over the first ``vocab`` columns (an online softmax: a running
        maximum and sum, block by block), its loss, then, reading the row again (mostly from L2),
        softmax - one-hot over ``count`` into every one of the ``width`` columns of the gradient.
        (The loops' lengths are constants: Triton 3.6's interpreter cannot loop to a run-time bound.)"""
        row = tl.program_id(0).to(tl.int64)
        logits_ptr += row * logits_stride
        grad_ptr += row * grad_stride
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
        scale = tl.where(kept, 1.0 / tl.load(count_ptr).to(tl.float32), 0.0)
        for i in range(WIDTH_BLOCKS):
            cols = i * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(logits_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            p = tl.exp(x - log_sum_exp)
            g = tl.where(cols == target, p - 1.0, p) * scale
            tl.store(grad_ptr + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < width)


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
                                           WIDTH_BLOCKS=triton.cdiv(width, block), num_warps=warps)
    return losses.sum() / count, grad


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


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, vocab: int) -> Tensor:
    """``F.cross_entropy((hidden @ weight.T)[..., :vocab].float(), targets)`` over (..., C) ``hidden``
    and (rows >= vocab, C) ``weight``, in autocast's dtype where it is on: by the operator where
    the kernel can run (:func:`usable`) and the vocabulary has ``FUSED_FROM_VOCAB`` tokens or more,
    else as written. (Replayed from a CUDA graph on an H200, the operator's forward and backward
    passes took 0.68-0.88x compiled PyTorch's time from 65 to 20,352 tokens, 0.56x at 50,304:
    loss_kernel_h200.json.) Targets must be below ``vocab`` or -100 (the operator does not check)."""
    hidden, targets = hidden.flatten(0, -2), targets.flatten()
    if usable(hidden) and vocab >= FUSED_FROM_VOCAB:
        return fused_linear_cross_entropy(hidden, weight, targets, vocab)
    return pytorch_linear_cross_entropy(hidden, weight, targets, vocab)


def pytorch_linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, vocab: int) -> Tensor:
    """:func:`linear_cross_entropy` of (N, C) ``hidden`` and (N,) ``targets`` as PyTorch's
    operations: the logits, the vocabulary's slice of them, float32 ``F.cross_entropy``."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy((logits if logits.shape[-1] == vocab else logits[:, :vocab]).float(), targets)


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, vocab: int) -> Tensor:
    """:func:`linear_cross_entropy` of (N, C) ``hidden`` and (N,) ``targets`` by the operator."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    return _linear_cross_entropy(hidden, weight, targets, vocab)[0]
