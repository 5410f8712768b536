"""Building blocks shared by the model files."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..compiling import kernels_may_compile_now

if torch.version.cuda or torch.version.hip:  # (importing Triton takes 0.2 s; a CPU build has no use for it)
    from . import max_pool_kernel
else:
    max_pool_kernel = None  # (TritonMaxPool2d asks for it only for tensors on a GPU)

# In compiled training on a GPU, each 1x1 convolution that widens its input (ResNet-50's
# expansions) takes its batch norm's statistics from that input, 2-4x smaller than the output, and
# folds the batch norm into itself (:meth:`ConvBatchNormAct.gram_forward`): a faster compiled
# ResNet-50 step (docs/results.md). Eager, the fold's
# two dozen small operations per layer are launched one by one from Python every step, which
# costs more host time than the passes it saves, and unfused they are slower on the GPU too
# (docs/training.md). Off (False): every batch norm runs as ``nn.BatchNorm2d`` does, compiled too,
# e.g. to measure the difference.
FOLD_BATCH_NORMS = True


def eager_forward(cls):
    """Class decorator: ``cls.forward`` runs outside torch.compile's graphs (torch.compiler.disable:
    for what inductor cannot generate code for, e.g. complex FFTs, or updates made in a backward
    pass); the step graph still captures its kernels. Applied when the first instance is built,
    not at import: importing Dynamo takes seconds that every command would otherwise pay."""
    build = cls.__init__

    @functools.wraps(build)
    def __init__(self, *args, **kwargs):
        if not getattr(cls.forward, "_eager", False):
            cls.forward = torch.compiler.disable(cls.forward)
            cls.forward._eager = True
        build(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def conv_bn_act(in_ch: int, out_ch: int, kernel: int = 3, stride: int = 1, groups: int = 1,
                act: type[nn.Module] | None = nn.ReLU, conv: type[nn.Conv2d] = nn.Conv2d) -> nn.Sequential:
    """Convolution (no bias: the batch norm has one), batch norm, activation."""
    layers = [conv(in_ch, out_ch, kernel, stride, kernel // 2, groups=groups, bias=False),
              nn.BatchNorm2d(out_ch)]
    if act is not None:
        layers.append(act(inplace=True))
    return ConvBatchNormAct(*layers)


class ConvBatchNormAct(nn.Sequential):
    """A convolution, its batch norm and an optional activation, as ``nn.Sequential`` (same
    parameters, buffers and names). In compiled training on a GPU with :data:`FOLD_BATCH_NORMS` on,
    a widening 1x1 convolution takes its batch norm's statistics from its input and folds the
    batch norm in (:meth:`gram_forward`) instead of a pass of its own over the output; the batch
    norm's arithmetic is written out here, the running statistics updated as ``nn.BatchNorm2d``
    does, the variance taken as E[y^2] - E[y]^2 in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if FOLD_BATCH_NORMS and self.training and x.is_cuda and torch.compiler.is_compiling() and self.fusable() \
                and self.widening_1x1():
            return self.gram_forward(x)
        return super().forward(x)

    def fusable(self) -> bool:
        conv, norm = self[0], self[1]
        return type(conv) is nn.Conv2d and type(norm) is nn.BatchNorm2d and conv.groups == 1 \
            and conv.bias is None and conv.dilation == (1, 1) and conv.padding_mode == "zeros" \
            and not isinstance(conv.padding, str) and conv.stride[0] == conv.stride[1] \
            and conv.padding[0] == conv.padding[1] and norm.affine and norm.track_running_stats \
            and norm.momentum is not None and (len(self) == 2 or type(self[2]) is nn.ReLU)

    def widening_1x1(self) -> bool:
        """A 1x1 convolution at stride 1 to at least twice its input channels: its input's Gram
        matrix is cheaper to read than its output (:func:`gram_statistics`)."""
        conv = self[0]
        return conv.kernel_size == (1, 1) and conv.stride == (1, 1) and conv.padding in (0, (0, 0)) \
            and conv.out_channels >= 2 * conv.in_channels

    def gram_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The module's result with its batch norm folded into the convolution: the statistics
        come from the input (:func:`gram_statistics`) before the convolution runs, the scale
        multiplies the weights and the shift is added to the output. Autograd differentiates
        through the statistics, so the backward pass has no batch-norm pass over the output
        either: the statistics' gradient reaches the input through its Gram matrix, a product
        over the smaller tensor."""
        conv = self[0]
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        total, squares = gram_statistics(x.to(dtype), conv.weight)
        scale, shift = self.normalisation(total, squares, x.numel() // x.shape[1])
        y = F.conv2d(x, conv.weight * scale.view(-1, 1, 1, 1))
        out = (y + shift.view(1, -1, 1, 1)).to(y.dtype)
        return torch.relu(out) if len(self) > 2 else out

    def normalisation(self, total: torch.Tensor, squares: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, shift): the batch norm as a per-channel affine map, given its input's
        per-channel sum and sum of squares over ``count`` elements each; updates the running
        statistics as ``nn.BatchNorm2d`` does."""
        norm = self[1]
        mean = total / count
        variance = (squares / count - mean * mean).clamp_min(0)
        with torch.no_grad():
            norm.running_mean.lerp_(mean, norm.momentum)
            norm.running_var.lerp_(variance * (count / max(count - 1, 1)), norm.momentum)
            norm.num_batches_tracked.add_(1)
        scale = norm.weight * torch.rsqrt(variance + norm.eps)
        return scale, norm.bias - mean * scale


def gram_statistics(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel sum and sum of squares (fp32) of ``conv2d(x, weight)`` for a 1x1
    ``weight``, computed from ``x``: each output pixel is ``W @ x_p``, so the sum is ``W @ sum_p
    x_p`` and the sum of squares of channel c is ``w_c @ G @ w_c`` with ``G = sum_p x_p x_p^T``.
    Differentiable in both arguments.

    Why: for a 1x1 convolution that widens its input (ResNet-50's expansions, 2-4x) reading the
    input and a cuBLAS matrix product over it moves a half or less of the bytes of reading the
    output, which is what a batch norm's own statistics pass does."""
    gram, total = _GramMatrix.apply(x)
    w = weight.flatten(1).to(gram.dtype)
    with torch.autocast(x.device.type, enabled=False):  # fp32 (autocast would take bf16)
        return w @ total, ((w @ gram) * w).sum(1)


class _GramMatrix(torch.autograd.Function):
    """``(G, s)`` for an (N, C, H, W) ``x``: its channels' Gram matrix ``sum_p x_p x_p^T`` and sum
    ``sum_p x_p`` over the pixels p, both at least fp32. The input's gradient is ``x_p (dG +
    dG^T) + ds`` at each pixel: one matrix product over ``x`` with a C x C matrix."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        pixels, channels = x.numel() // x.shape[1], x.shape[1]
        # (chunks, pixels per chunk, channels): a view in channels-last. One product per chunk,
        # then their sum: a single product over a million pixels into a 64 x 64 result leaves
        # most of the GPU idle
        chunks = _chunks(pixels)
        flat = x.permute(0, 2, 3, 1).reshape(chunks, pixels // chunks, channels)
        wide = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):  # fp32 throughout (autocast would take bf16)
            if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
                gram = torch.bmm(flat.transpose(1, 2), flat, out_dtype=wide)  # fp32 sums of 16-bit products
            else:
                gram = torch.bmm(flat.transpose(1, 2).to(wide), flat.to(wide))
            return gram.sum(0), flat.sum((0, 1), dtype=wide)

    @staticmethod
    def backward(ctx, grad_gram, grad_total):
        x, = ctx.saved_tensors
        n, channels, height, width = x.shape
        with torch.autocast(x.device.type, enabled=False):
            flat = x.permute(0, 2, 3, 1).reshape(-1, channels)
            grad = torch.addmm(grad_total.to(x.dtype), flat, (grad_gram + grad_gram.t()).to(x.dtype))
        return grad.view(n, height, width, channels).permute(0, 3, 1, 2)


def _chunks(pixels: int, least: int = 2048) -> int:
    """The largest power of two that divides ``pixels`` into chunks of at least ``least``."""
    chunks = 1
    while pixels % (2 * chunks) == 0 and pixels // (2 * chunks) >= least:
        chunks *= 2
    return chunks


def init_weights(model: nn.Module) -> None:
    """He initialisation for convolutions, unit batch norms, small linear layers."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)


class SpaceToDepthConv2d(nn.Conv2d):
    """A strided convolution over few input channels (an image stem) that on a GPU is computed
    as a stride-1 convolution over its input rearranged space-to-depth: the same parameters and
    the same result, up to the order of the sums.

    Why: cuDNN has no fast kernel for three input channels: ResNet-50's 7x7 stride-2 stem ran at
    a small fraction of the tensor cores' rate, a large share of the step for its arithmetic. Rearranged,
    each s x s block of pixels becomes s*s*C channels (padded to a multiple of 8) and the
    kernel becomes ceil(k/s) x ceil(k/s) (zero-padded), which cuDNN runs on tensor cores.
    On a CPU it stays an ordinary convolution.
    """

    channel_multiple = 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda or self.groups != 1 or self.dilation != (1, 1) or self.padding_mode != "zeros" \
                or self.stride[0] != self.stride[1] or isinstance(self.padding, str) or self.stride[0] == 1:
            return super().forward(x)
        return space_to_depth_conv2d(x, self.weight, self.bias, self.stride[0], self.padding, self.channel_multiple)


def space_to_depth_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int,
                          padding: tuple[int, int], channel_multiple: int = 8) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding)`` computed as a stride-1 convolution over
    the space-to-depth rearrangement of ``x``."""
    s = stride
    out_ch, in_ch, kh, kw = weight.shape
    n, _, h, w = x.shape
    blocks_h, blocks_w = -(-kh // s), -(-kw // s)  # kernel size after the rearrangement
    out_h, out_w = (h + 2 * padding[0] - kh) // s + 1, (w + 2 * padding[1] - kw) // s + 1
    rows, cols = out_h + blocks_h - 1, out_w + blocks_w - 1  # rearranged input size
    # pad (or crop) so the input is exactly rows x cols blocks of s x s pixels
    x = F.pad(x, (padding[1], s * cols - w - padding[1], padding[0], s * rows - h - padding[0]))
    x = x.reshape(n, in_ch, rows, s, cols, s).permute(0, 3, 5, 1, 2, 4).reshape(n, s * s * in_ch, rows, cols)
    weight = F.pad(weight, (0, blocks_w * s - kw, 0, blocks_h * s - kh))
    weight = weight.reshape(out_ch, in_ch, blocks_h, s, blocks_w, s).permute(0, 3, 5, 1, 2, 4)
    weight = weight.reshape(out_ch, s * s * in_ch, blocks_h, blocks_w)
    extra = -s * s * in_ch % channel_multiple
    if extra:
        x = F.pad(x, (0, 0, 0, 0, 0, extra))
        weight = F.pad(weight, (0, 0, 0, 0, 0, extra))
    return F.conv2d(x.contiguous(memory_format=torch.channels_last), weight, bias)


class TritonMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` whose forward and backward passes run as the Triton kernels of
    :mod:`max_pool_kernel` on a GPU, and as PyTorch's elsewhere: the same results, in about half
    inductor's time at ResNet-50's stem."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = (self.kernel_size, self.stride, self.padding)
        square = all(isinstance(v, int) for v in params)
        if not (square and x.is_cuda and max_pool_kernel.usable(x)) or self.dilation not in (1, (1, 1)) \
                or self.ceil_mode or self.return_indices or self.kernel_size > max_pool_kernel.LARGEST_KERNEL \
                or not kernels_may_compile_now():
            return super().forward(x)  # (ATen's; uncompiled in a run that avoids Triton's first compiles too)
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or (x.requires_grad and torch.is_grad_enabled()):
            return max_pool_kernel.max_pool2d(x, *params)[0]  # (what autograd, compilers and tracers see)
        return max_pool_kernel.pooled(x, *params)[0]  # (inference: the kernel without the operator)


class Linear(nn.Linear):
    """``nn.Linear`` whose float32 weight, in training under CUDA autocast, gets its gradient from
    one matrix product written in float32 (``torch.mm``'s ``out_dtype``). Autocast's own gradient
    is the product rounded to bf16 (or fp16), then cast to float32 by a pass of its own: GPT-2
    small's compiled step (no CUDA graph) took 29.38 ms on an H200 with this gradient, 29.62 with
    autocast's (benchmarks/gpt2_speed/results/step_variants_weight_grad_h200.json). The forward pass and the
    input's gradient are autocast's; everywhere else (CPUs, evaluation, another weight dtype) this
    is ``nn.Linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.weight.dtype == torch.float32 and self.weight.requires_grad \
                and torch.is_grad_enabled() and torch.is_autocast_enabled("cuda"):
            return _LinearFloat32WeightGradient.apply(x, self.weight, self.bias, torch.get_autocast_dtype("cuda"))
        return super().forward(x)


class _LinearFloat32WeightGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        x, weight = x.to(dtype), weight.to(dtype)  # (what autocast casts, and keeps for the backward pass)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        with torch.autocast("cuda", enabled=False):
            return F.linear(x, weight, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.to(x.dtype)
        rows = grad.flatten(0, -2)
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = torch.mm(rows.t(), x.flatten(0, -2), out_dtype=torch.float32)
        grad_bias = rows.sum(0, dtype=torch.float32) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm``, with its gradient written out on a CPU. There PyTorch runs RMSNorm's
    backward pass as the autograd of a dozen elementwise kernels, several times LayerNorm's fused
    one; the gradient by hand takes fewer passes (benchmarks/cpu_baseline/rotary_swap.py times the
    model's step with either). The forward pass is the same computation (the same results to the
    bit); on GPUs (where torch.compile fuses it), compiled, without gradients (evaluation, export)
    and under autocast it is ``nn.RMSNorm`` itself, its scale cast to a lower-precision input's dtype
    (GPT's ``residual_bf16``), as autocast casts a linear layer's weight (PyTorch's fused kernel needs
    one dtype, and warns). The parameters and their names are its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and x.dtype != self.weight.dtype and torch.is_autocast_enabled(x.device.type):
            return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)
        if torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype != torch.float32 \
                or self.weight is None or not torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return _RMSNormByHand.apply(x, self.weight, eps, len(self.normalized_shape))


class _RMSNormByHand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, dims):
        over = tuple(range(-dims, 0))
        scale = torch.rsqrt(x.pow(2).mean(over, keepdim=True).add_(eps))
        normed = x * scale
        ctx.save_for_backward(normed, scale, weight)
        ctx.over = over
        return normed * weight

    @staticmethod
    def backward(ctx, grad):
        normed, scale, weight = ctx.saved_tensors
        grad_normed = grad * weight
        along = (grad_normed * normed).mean(ctx.over, keepdim=True)
        grad_x = torch.addcmul(grad_normed, normed, along, value=-1).mul_(scale)
        grad_weight = (grad * normed).sum(tuple(range(grad.dim() - weight.dim())))
        return grad_x, grad_weight, None, None


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``F.dropout(x, p, training)``, with the mask drawn from uniform numbers on a CPU.

    Why: PyTorch's CPU dropout draws its mask with ``bernoulli_``, 2-3x slower than ``rand_like``
    and a comparison; in an eager training step of a small transformer on a CPU, its masks took a
    fifth of the time (benchmarks/cpu_baseline/rotary_swap.py). The mask keeps each element with
    probability 1 - p and scales it by 1 / (1 - p), as PyTorch's does, from other random numbers.
    Compiled, on GPUs and in other dtypes it is ``F.dropout`` itself."""
    return x * _keep_mask(x, p) if _cpu_mask(x, p, training) else F.dropout(x, p, training)


def dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``residual + dropout(x, p, training)``; where :func:`dropout` draws its own mask, in one
    pass (``addcmul``) rather than two and a tensor between them."""
    if _cpu_mask(x, p, training):
        return torch.addcmul(residual, x, _keep_mask(x, p))
    return residual + F.dropout(x, p, training)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, training: bool, *,
              causal: bool = False, attend: torch.Tensor | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=attend, dropout_p=p if training else
    0, is_causal=causal)``; where :func:`dropout` draws its own mask, computed as SDPA's
    reference path does (on a CPU SDPA takes that path when it drops weights), with that mask:
    there ``bernoulli_`` over every weight took a tenth of an eager step. ``attend``: True where a
    query may attend to a key."""
    if not _cpu_mask(q, p, training):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attend, dropout_p=p if training else 0.0,
                                              is_causal=causal)
    scores = (q @ k.transpose(-2, -1)).mul_(q.shape[-1] ** -0.5)
    if causal:
        t, s = scores.shape[-2:]
        scores.masked_fill_(torch.ones(t, s, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    if attend is not None:  # (a query with no key to attend to, an empty sentence's, sees them all, not NaN)
        scores.masked_fill_(~(attend | ~attend.any(-1, keepdim=True)), float("-inf"))
    return dropout(scores.softmax(-1), p, True) @ v


def _cpu_mask(x: torch.Tensor, p: float, training: bool) -> bool:
    """Whether dropout here draws its mask as :func:`dropout` says (eager float32 on a CPU)."""
    return training and 0.0 < p < 1.0 and x.device.type == "cpu" and x.dtype == torch.float32 \
        and not torch.compiler.is_compiling()


def _keep_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout's multiplier for ``x``: 1 / (1 - p) with probability 1 - p, else 0."""
    return torch.rand_like(x).ge_(p).div_(1.0 - p)


class Dropout(nn.Dropout):
    """``nn.Dropout`` through :func:`dropout` (a faster mask on a CPU); the same module otherwise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.inplace else dropout(x, self.p, self.training)
