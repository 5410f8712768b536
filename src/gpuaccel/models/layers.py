"""Building blocks shared by the model files."""

from __future__ import annotations

import torch.nn as nn


def conv_bn_act(in_ch: int, out_ch: int, kernel: int = 3, stride: int = 1, groups: int = 1,
                act: type[nn.Module] | None = nn.ReLU) -> nn.Sequential:
    """Convolution (no bias: the batch norm has one), batch norm, activation."""
    layers = [nn.Conv2d(in_ch, out_ch, kernel, stride, kernel // 2, groups=groups, bias=False),
              nn.BatchNorm2d(out_ch)]
    if act is not None:
        layers.append(act(inplace=True))
    return nn.Sequential(*layers)


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
