"""Dense-prediction models: a backbone's feature maps merged by a feature pyramid (Lin et al.,
2017) into one map at 1/4 of the input's resolution, and a head on it.

- ``centernet``: an object detector (tasks.Detection): per class a heat map of object centres,
  and per position the centre's offset and the box's size (CenterNet, Zhou et al., 2019);
- ``unet``: U-Net, semantic segmentation with a decoder at every resolution;
- ``fpn_segmenter``: semantic segmentation (tasks.Segmentation): per-pixel class logits at the
  input's resolution (the pyramid's map upsampled and joined with full-resolution detail).

``backbone``: a registered ResNet (``resnet18``, ``resnet34``, ``resnet50``; ``width`` narrows
it) or ``timm:<name>`` (any timm model with ``features_only``). The pyramid takes the last four
stages (strides 4, 8, 16, 32), adds each coarser map, upsampled, to the finer one's 1x1
projection, and smooths the finest with a 3x3 convolution.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import GpuaccelError
from .layers import conv_bn_act, init_weights
from .registry import register_model
from .resnet import BasicBlock, Bottleneck, ResNet

RESNETS = {"resnet18": (BasicBlock, (2, 2, 2, 2)), "resnet34": (BasicBlock, (3, 4, 6, 3)),
           "resnet50": (Bottleneck, (3, 4, 6, 3))}
STRIDE = 4  # of the pyramid's output


class ResNetFeatures(nn.Module):
    """A gpuaccel ResNet's stem and stages, returning every stage's output (strides 4 to 32 from
    64-pixel images up)."""

    def __init__(self, name: str, in_channels: int, width: int = 64):
        super().__init__()
        block, depths = RESNETS[name]
        net = ResNet(block, depths, num_classes=1, in_channels=in_channels, image_size=224, width=width)
        self.stem, self.stages = net.stem, net.stages
        self.channels = [width * 2 ** i * block.expansion for i in range(len(depths))]

    def forward(self, x):
        features = []
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
            features.append(x)
        return features


class TimmFeatures(nn.Module):
    def __init__(self, name: str, in_channels: int):
        super().__init__()
        try:
            import timm
        except ImportError:
            raise GpuaccelError("timm backbones need the timm package: pip install timm") from None
        if not timm.list_models(name):
            raise GpuaccelError(f"timm has no model {name!r}; see timm.list_models()")
        self.net = timm.create_model(name, pretrained=False, features_only=True, in_chans=in_channels)
        reductions = self.net.feature_info.reduction()
        self.keep = [i for i, r in enumerate(reductions) if r >= STRIDE][-4:]
        if len(self.keep) < 2 or reductions[self.keep[0]] != STRIDE:
            raise GpuaccelError(f"timm:{name} has no feature maps at strides 4 to 32 (it has {reductions})")
        self.channels = [self.net.feature_info.channels()[i] for i in self.keep]

    def forward(self, x):
        features = self.net(x)
        return [features[i] for i in self.keep]


def backbone_features(backbone: str, in_channels: int, width: int) -> nn.Module:
    if backbone.startswith("timm:"):
        return TimmFeatures(backbone[5:], in_channels)
    if backbone not in RESNETS:
        raise GpuaccelError(f"backbone {backbone!r}: choose {', '.join(RESNETS)} or timm:<name>")
    return ResNetFeatures(backbone, in_channels, width)


class FeaturePyramid(nn.Module):
    """Feature maps at strides 4, 8, 16, 32 -> one map of ``channels`` at stride 4."""

    def __init__(self, in_channels: list[int], channels: int):
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(c, channels, 1) for c in in_channels)
        self.smooth = conv_bn_act(channels, channels, 3)

    def forward(self, features):
        x = self.lateral[-1](features[-1])
        for lateral, feature in zip(reversed(self.lateral[:-1]), reversed(features[:-1])):
            x = lateral(feature) + F.interpolate(x, size=feature.shape[-2:], mode="nearest")
        return self.smooth(x)


class PixelHead(nn.Module):
    """Per-pixel outputs at the input's resolution: the pyramid's map, narrowed and upsampled, joined
    with two full-resolution convolutions of the image itself (U-Net's skip at its finest level),
    which give thin structures (strokes, edges) back the detail that stride 4 loses."""

    def __init__(self, in_channels: int, channels: int, outputs: int, fine: int = 32, detail: int = 16):
        super().__init__()
        self.narrow = conv_bn_act(channels, fine, 1)
        self.detail = nn.Sequential(conv_bn_act(in_channels, detail, 3), conv_bn_act(detail, detail, 3))
        self.fuse = nn.Sequential(conv_bn_act(fine + detail, fine, 3), nn.Conv2d(fine, outputs, 1))

    def forward(self, features, image):
        coarse = F.interpolate(self.narrow(features), size=image.shape[-2:], mode="bilinear", align_corners=False)
        return self.fuse(torch.cat([coarse, self.detail(image)], 1))


class DenseModel(nn.Module):
    """backbone -> pyramid -> head: outputs at stride 4 (``per_pixel``: at the input's resolution)."""

    def __init__(self, backbone: str, in_channels: int, outputs: int, *, width: int, channels: int,
                 per_pixel: bool):
        super().__init__()
        self.backbone = backbone_features(backbone, in_channels, width)
        self.pyramid = FeaturePyramid(self.backbone.channels, channels)
        self.head = PixelHead(in_channels, channels, outputs) if per_pixel else \
            nn.Sequential(conv_bn_act(channels, channels, 3), nn.Conv2d(channels, outputs, 1))
        self.per_pixel = per_pixel
        self.stride = 1 if per_pixel else STRIDE
        init_weights(self.pyramid)
        init_weights(self.head)

    def forward(self, x):
        features = self.pyramid(self.backbone(x))
        return self.head(features, x) if self.per_pixel else self.head(features)


@register_model("centernet")
def centernet(num_classes=10, in_channels=3, backbone: str = "resnet18", width: int = 64, channels: int = 128):
    """An object detector: ``num_classes`` centre heat maps and 4 box channels at stride 4."""
    model = DenseModel(backbone, in_channels, num_classes + 4, width=width, channels=channels, per_pixel=False)
    last = model.head[-1]
    nn.init.normal_(last.weight, std=0.01)
    nn.init.zeros_(last.bias)
    with torch.no_grad():  # heat maps start at probability 0.1: the focal loss starts small and stable
        last.bias[:num_classes] = -math.log((1 - 0.1) / 0.1)
    return model


@register_model("fpn_segmenter")
def fpn_segmenter(num_classes=2, in_channels=3, backbone: str = "resnet18", width: int = 64, channels: int = 128):
    """Semantic segmentation: ``num_classes`` (background included) logits per pixel."""
    return DenseModel(backbone, in_channels, num_classes, width=width, channels=channels, per_pixel=True)


class UNet(nn.Module):
    """U-Net (Ronneberger et al., 2015) with batch norm: ``levels`` downsamplings, ``width`` channels
    at full resolution doubling per level, each decoder level joined with its encoder's map."""

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 32, levels: int = 4):
        super().__init__()
        widths = [width * 2 ** k for k in range(levels + 1)]

        def double(i, o):
            return nn.Sequential(conv_bn_act(i, o, 3), conv_bn_act(o, o, 3))

        self.down = nn.ModuleList([double(in_channels, widths[0])] +
                                  [double(widths[k], widths[k + 1]) for k in range(levels)])
        self.up = nn.ModuleList(nn.ConvTranspose2d(widths[k + 1], widths[k], 2, stride=2) for k in range(levels))
        self.merge = nn.ModuleList(double(2 * widths[k], widths[k]) for k in range(levels))
        self.out = nn.Conv2d(widths[0], num_classes, 1)
        init_weights(self)

    def forward(self, x):
        skips = []
        for k, down in enumerate(self.down):
            x = down(x if k == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        for k in reversed(range(len(self.up))):
            x = self.merge[k](torch.cat([skips[k], self.up[k](x)], 1))
        return self.out(x)


@register_model("unet")
def unet(num_classes=2, in_channels=3, width: int = 32, levels: int = 4):
    """Semantic segmentation: ``num_classes`` (background included) logits per pixel."""
    return UNet(num_classes, in_channels, width, levels)
