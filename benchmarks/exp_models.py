"""FastNet variants used in the recipe experiments of docs/results.md (round 4), as user
models: ``--model exp_models:NAME`` with ``benchmarks/`` on PYTHONPATH.

The ``*_frozen`` variants freeze the whitening layer's bias, which FastNet itself now does;
``fastnet_adaptive`` is FastNet with its former global pooling (adaptive_max_pool2d).
"""
import torch
import torch.nn.functional as F

from gpuaccel.models.fastnet import FastNet


def res_128_512_512(num_classes=10, in_channels=3, image_size=32, **kw):
    return FastNet(num_classes, in_channels, image_size, widths=(128, 512, 512), residual=True)


def res_128_384_384(num_classes=10, in_channels=3, image_size=32, **kw):
    return FastNet(num_classes, in_channels, image_size, widths=(128, 384, 384), residual=True)


class FastNetAdaptivePool(FastNet):
    def forward(self, x):
        x = self.stages(F.gelu(self.whiten(x)))
        return self.head(F.adaptive_max_pool2d(x, 1).flatten(1)) * self.head_scale


def fastnet_adaptive(num_classes=10, in_channels=3, image_size=32, **kw):
    return FastNetAdaptivePool(num_classes, in_channels, image_size)


def _freeze(model, zero=False):
    if zero:
        model.whiten.bias.data.zero_()
    model.whiten.bias.requires_grad_(False)
    return model


def fastnet_frozen(num_classes=10, in_channels=3, image_size=32, **kw):
    return _freeze(FastNet(num_classes, in_channels, image_size))


def fastnet_frozen0(num_classes=10, in_channels=3, image_size=32, **kw):
    return _freeze(FastNet(num_classes, in_channels, image_size), zero=True)


def res_frozen(num_classes=10, in_channels=3, image_size=32, **kw):
    return _freeze(FastNet(num_classes, in_channels, image_size, widths=(128, 384, 512), residual=True))


def res512_frozen(num_classes=10, in_channels=3, image_size=32, **kw):
    return _freeze(FastNet(num_classes, in_channels, image_size, widths=(128, 512, 512), residual=True))


# Ghost batch norm, not yet measured: on 4 GPUs (batch norm over each GPU's 256 images) the fast
# recipe reached 91.0-91.1% against 90.6-90.7% on one GPU. These normalise each 256-image chunk
# of a training batch with its own statistics on one GPU, to see whether that is the cause.

from gpuaccel.models.fastnet import FixedScaleBatchNorm  # noqa: E402


class GhostBatchNorm(FixedScaleBatchNorm):
    def __init__(self, channels: int, chunk: int = 256, **kw):
        super().__init__(channels, **kw)
        self.chunk = chunk

    def forward(self, x):
        n = x.shape[0]
        if not self.training or n <= self.chunk or n % self.chunk:
            return super().forward(x)
        chunks = x.view(n // self.chunk, self.chunk, *x.shape[1:])
        var, mean = torch.var_mean(chunks.float(), dim=(1, 3, 4), correction=0, keepdim=True)
        y = ((chunks - mean) * torch.rsqrt(var + self.eps)).view_as(x)
        y = y * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)
        with torch.no_grad():
            count = self.chunk * x.shape[2] * x.shape[3]
            self.running_mean.lerp_(mean.mean(0).flatten(), self.momentum)
            self.running_var.lerp_(var.mean(0).flatten() * count / (count - 1), self.momentum)
        return y.to(x.dtype)


def _ghost(model, chunk):
    for stage in model.stages:
        for name in ("norm1", "norm2", "norm3"):
            norm = getattr(stage, name, None)
            if norm is not None:
                ghost = GhostBatchNorm(norm.num_features, chunk, momentum=norm.momentum, eps=norm.eps)
                setattr(stage, name, ghost)
    return model


def fastnet_ghost256(num_classes=10, in_channels=3, image_size=32, **kw):
    return _ghost(FastNet(num_classes, in_channels, image_size), 256)


def fastnet_ghost512(num_classes=10, in_channels=3, image_size=32, **kw):
    return _ghost(FastNet(num_classes, in_channels, image_size), 512)


def res_ghost256(num_classes=10, in_channels=3, image_size=32, **kw):
    return _ghost(FastNet(num_classes, in_channels, image_size, widths=(128, 384, 512), residual=True), 256)
