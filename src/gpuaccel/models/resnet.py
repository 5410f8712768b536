"""ResNet-18/34/50 (He et al., 2015) with a stem chosen by image size.

Below 64 px the stem is one 3x3 convolution at stride 1 with no max pooling (the
CIFAR-style stem: downsampling 32 px images by 4 at once throws away most of the
image); from 64 px up it is ImageNet's 7x7 stride-2 convolution and max pooling.
"""

from __future__ import annotations

import torch.nn as nn

from .layers import SpaceToDepthConv2d, TritonMaxPool2d, conv_bn_act, init_weights
from .registry import register_model

SMALL_IMAGE_LIMIT = 64


class _ResidualBlock(nn.Module):
    """relu(branch(x) + shortcut(x)), the branch a chain of ConvBatchNormAct (``convs``), each
    but the last with a ReLU."""

    convs: tuple[str, ...]

    def forward(self, x):
        y = x
        for name in self.convs:
            y = getattr(self, name)(y)
        return self.relu(y + self.shortcut(x))


class BasicBlock(_ResidualBlock):
    expansion = 1
    convs = ("conv1", "conv2")

    def __init__(self, in_ch: int, ch: int, stride: int):
        super().__init__()
        self.conv1 = conv_bn_act(in_ch, ch, 3, stride)
        self.conv2 = conv_bn_act(ch, ch, 3, 1, act=None)
        self.shortcut = _shortcut(in_ch, ch, stride)
        self.relu = nn.ReLU(inplace=True)


class Bottleneck(_ResidualBlock):
    expansion = 4
    convs = ("conv1", "conv2", "conv3")

    def __init__(self, in_ch: int, ch: int, stride: int):
        super().__init__()
        out = ch * self.expansion
        self.conv1 = conv_bn_act(in_ch, ch, 1)
        self.conv2 = conv_bn_act(ch, ch, 3, stride)
        self.conv3 = conv_bn_act(ch, out, 1, act=None)
        self.shortcut = _shortcut(in_ch, out, stride)
        self.relu = nn.ReLU(inplace=True)


def _shortcut(in_ch: int, out_ch: int, stride: int) -> nn.Module:
    if stride == 1 and in_ch == out_ch:
        return nn.Identity()
    return conv_bn_act(in_ch, out_ch, 1, stride, act=None)


class ResNet(nn.Module):
    def __init__(self, block, depths, num_classes: int = 10, in_channels: int = 3, image_size: int = 32,
                 width: int = 64):
        super().__init__()
        if image_size < SMALL_IMAGE_LIMIT:
            self.stem = conv_bn_act(in_channels, width, 3, 1)
        else:
            self.stem = nn.Sequential(conv_bn_act(in_channels, width, 7, 2, conv=SpaceToDepthConv2d),
                                      TritonMaxPool2d(3, 2, 1))
        stages, in_ch = [], width
        for i, depth in enumerate(depths):
            ch = width * 2 ** i
            blocks = []
            for j in range(depth):
                blocks.append(block(in_ch, ch, 2 if (j == 0 and i > 0) else 1))
                in_ch = ch * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)
        init_weights(self)
        nn.init.kaiming_uniform_(self.fc.weight, a=5 ** 0.5)
        for m in self.modules():  # each residual branch starts as identity: trains faster and deeper
            if isinstance(m, (BasicBlock, Bottleneck)):
                last = m.conv3 if isinstance(m, Bottleneck) else m.conv2
                nn.init.zeros_(last[1].weight)

    def forward(self, x):
        return self.fc(self.pool(self.stages(self.stem(x))).flatten(1))


@register_model("resnet18")
def resnet18(num_classes=10, in_channels=3, image_size=32, **kw):
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes, in_channels, image_size, **kw)


@register_model("resnet34")
def resnet34(num_classes=10, in_channels=3, image_size=32, **kw):
    return ResNet(BasicBlock, (3, 4, 6, 3), num_classes, in_channels, image_size, **kw)


@register_model("resnet50")
def resnet50(num_classes=10, in_channels=3, image_size=32, **kw):
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes, in_channels, image_size, **kw)
