"""FastNet variants used in the recipe experiments of docs/results.md (round 4), as user
models: ``--model exp_models:NAME`` with ``benchmarks/`` on PYTHONPATH.

The ``*_frozen`` variants freeze the whitening layer's bias, which FastNet itself now does;
``fastnet_adaptive`` is FastNet with its former global pooling (adaptive_max_pool2d).
"""
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
