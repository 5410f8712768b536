"""MobileNetV2 (Sandler et al., 2018): inverted residual blocks with linear bottlenecks.

For images under 64 px the first convolution and the first downsampling stage keep
stride 1, so a 32 px image still reaches a 4x4 feature map rather than 1x1.
"""

from __future__ import annotations

import torch.nn as nn

from .layers import conv_bn_act, init_weights
from .registry import register_model

# expansion t, output channels c, repeats n, first stride s
_SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
             (6, 320, 1, 1))


class InvertedResidual(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int, expansion: int):
        super().__init__()
        hidden = in_ch * expansion
        layers = [] if expansion == 1 else [conv_bn_act(in_ch, hidden, 1, act=nn.ReLU6)]
        layers += [conv_bn_act(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6),
                   conv_bn_act(hidden, out_ch, 1, act=None)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and in_ch == out_ch

    def forward(self, x):
        return x + self.block(x) if self.residual else self.block(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32, width_mult: float = 1.0,
                 dropout: float = 0.2):
        super().__init__()
        small = image_size < 64
        def ch(c):
            return max(8, int(c * width_mult + 4) // 8 * 8)
        layers = [conv_bn_act(in_channels, ch(32), 3, 1 if small else 2, act=nn.ReLU6)]
        in_ch = ch(32)
        for i, (t, c, n, s) in enumerate(_SETTINGS):
            if small and i == 1:
                s = 1
            for j in range(n):
                layers.append(InvertedResidual(in_ch, ch(c), s if j == 0 else 1, t))
                in_ch = ch(c)
        last = max(1280, ch(1280))
        layers.append(conv_bn_act(in_ch, last, 1, act=nn.ReLU6))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(last, num_classes))
        self.pool = nn.AdaptiveAvgPool2d(1)
        init_weights(self)

    def forward(self, x):
        return self.classifier(self.pool(self.features(x)))


@register_model("mobilenet_v2")
def mobilenet_v2(num_classes=10, in_channels=3, image_size=32, **kw):
    return MobileNetV2(num_classes, in_channels, image_size, **kw)
