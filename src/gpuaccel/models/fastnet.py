"""A small, fast network for 32 px images, built for time-to-accuracy on CIFAR-10.

The ideas come from the public CIFAR-10 speed-run literature (Page's and Jordan's
work): a frozen first layer that whitens 2x2 patches of the data set (so the network
starts from decorrelated inputs), three conv-pool-norm stages, batch norms with a
fixed unit scale, partially identity-initialised convolutions, and a scaled linear
head. The whitening needs the data, so the model exposes ``data_init(images)``,
which the trainer calls once with normalised training images before training.
``fastnet_res`` is the deeper, wider variant for accuracy: a third convolution per
stage, with a residual connection over the stage's last two.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..compiling import kernels_may_compile_now
from ..errors import GpuaccelError
from . import small_conv_kernel
from .layers import TritonMaxPool2d
from .registry import register_model

ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": partial(F.gelu, approximate="tanh"), "silu": F.silu}


def whiten_activation(x: torch.Tensor, conv: nn.Conv2d, activation: str = "gelu") -> torch.Tensor:
    """activation(conv(x)) for the frozen whitening convolution: on a GPU, where no gradient reaches
    it, one Triton kernel (small_conv_kernel: about half the time of cuDNN's convolution and a GELU)."""
    params = (x, conv.weight, conv.bias)
    frozen = conv.bias is not None and not (torch.is_grad_enabled() and any(t.requires_grad for t in params))
    if frozen and conv.stride == (1, 1) and conv.padding == (0, 0) \
            and small_conv_kernel.usable(x, conv.weight, activation) and kernels_may_compile_now():
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        return small_conv_kernel.small_conv_activation(x, conv.weight, conv.bias, activation, dtype)
    return ACTIVATIONS[activation](conv(x))


class FixedScaleBatchNorm(nn.BatchNorm2d):
    """Batch norm that learns only its shift: the scale is redundant before a GELU and a
    scale-invariant next layer, and leaving it out trains faster."""

    def __init__(self, channels: int, momentum: float = 0.4, eps: float = 1e-5):
        super().__init__(channels, eps=eps, momentum=momentum)
        self.weight.requires_grad_(False)


class ConvStage(nn.Module):
    """conv, 2x2 max-pool, norm, GELU; conv, norm, GELU; with ``residual``, one more conv,
    norm, GELU, and the input of the last two convolutions added to their output. (GELU, or
    the ``activation`` named: :data:`ACTIVATIONS`.)"""

    def __init__(self, in_ch: int, out_ch: int, residual: bool = False, activation: str = "gelu"):
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False)
        # gpuaccel's pooling kernels on a GPU: torch.compile had fused max_pool2d's backward with the
        # batch norm's into cifar10-fast's largest kernel, a large share of its step's GPU time
        self.pool = TritonMaxPool2d(2)
        self.norm1 = FixedScaleBatchNorm(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.norm2 = FixedScaleBatchNorm(out_ch)
        convs = [self.conv1, self.conv2]
        self.residual = residual
        if residual:
            self.conv3 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
            self.norm3 = FixedScaleBatchNorm(out_ch)
            convs.append(self.conv3)
        for conv in convs:  # the first in_ch filters start as identity
            w = conv.weight.data
            nn.init.dirac_(w[: w.size(1)])

    def forward(self, x):
        x = self.act(self.norm1(self.pool(self.conv1(x))))
        if not self.residual:
            return self.act(self.norm2(self.conv2(x)))
        y = self.act(self.norm2(self.conv2(x)))
        return x + self.act(self.norm3(self.conv3(y)))


class FastNet(nn.Module):
    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32,
                 widths=(64, 256, 256), residual: bool = False, head_scale: float = 1 / 9,
                 activation: str = "gelu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise GpuaccelError(f"fastnet: activation is one of {', '.join(ACTIVATIONS)}, not {activation!r}")
        self.activation = activation
        patches = in_channels * 4
        self.whiten = nn.Conv2d(in_channels, 2 * patches, 2, padding=0, bias=True)
        # Frozen, bias included: then no gradient flows below the first stage, which spares the
        # backward pass a convolution and a GELU at full resolution, and cost no measurable
        # accuracy (docs/results.md)
        self.whiten.requires_grad_(False)
        stages, ch = [], 2 * patches
        for width in widths:
            stages.append(ConvStage(ch, width, residual, activation))
            ch = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(ch, num_classes, bias=False)
        self.head_scale = head_scale

    @torch.no_grad()
    def data_init(self, images: torch.Tensor, eps: float = 5e-4) -> None:
        """Sets the first layer to whiten 2x2 patches of ``images`` (N, C, H, W, normalised):
        filters are the covariance's eigenvectors scaled by 1/sqrt(eigenvalue), each with
        its negative, so no information is lost through the GELU that follows."""
        c = images.shape[1]
        patches = images.float().unfold(2, 2, 1).unfold(3, 2, 1)  # N, C, H-1, W-1, 2, 2
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, c * 4)
        patches = patches - patches.mean(0)
        covariance = patches.T @ patches / len(patches)
        eigenvalues, eigenvectors = torch.linalg.eigh(covariance.double())
        filters = (eigenvectors.T / torch.sqrt(eigenvalues[:, None] + eps)).float().view(-1, c, 2, 2)
        self.whiten.weight.copy_(torch.cat([filters, -filters]).to(self.whiten.weight))

    def forward(self, x):
        x = self.stages(whiten_activation(x, self.whiten, self.activation))
        # global max pooling as a plain max-pool over the whole (small) map: torch.compile turns
        # its backward into a fused kernel, where adaptive_max_pool2d's backward is an atomic
        # scatter that took a few per cent of the step; torch.amax compiled with bf16 autocast
        # (torch 2.11-2.13) gives NaN gradients
        x = F.max_pool2d(x, x.shape[-2:]).flatten(1)
        return self.head(x) * self.head_scale


@register_model("fastnet")
def fastnet(num_classes=10, in_channels=3, image_size=32, **kw):
    return FastNet(num_classes, in_channels, image_size, **kw)


@register_model("fastnet_wide")
def fastnet_wide(num_classes=10, in_channels=3, image_size=32, **kw):
    return FastNet(num_classes, in_channels, image_size, widths=(128, 384, 512), **kw)


@register_model("fastnet_res")
def fastnet_res(num_classes=10, in_channels=3, image_size=32, **kw):
    return FastNet(num_classes, in_channels, image_size, **{"widths": (128, 384, 512), "residual": True, **kw})
