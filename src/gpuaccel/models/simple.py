"""Small models: a multilayer perceptron and LeNet-5."""

from __future__ import annotations

import torch.nn as nn

from .registry import register_model


@register_model("mlp")
def mlp(num_classes: int = 10, in_channels: int = 1, image_size: int = 28, hidden: int = 512,
        dropout: float = 0.1) -> nn.Module:
    """Two hidden layers with batch norm; the baseline for any image size."""
    features = in_channels * image_size * image_size
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
        nn.Linear(hidden, hidden // 2), nn.BatchNorm1d(hidden // 2), nn.ReLU(inplace=True), nn.Dropout(dropout),
        nn.Linear(hidden // 2, num_classes),
    )


class LeNet5(nn.Module):
    """LeNet-5's layout (two 5x5 convolutions of 6 and 16 channels, each followed by 2x2
    pooling, then 120-84-classes) with batch norm and ReLU. 'Same' padding keeps it valid
    down to 8x8 images; the first fully connected layer's width follows the image size."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5, padding=2, bias=False), nn.BatchNorm2d(6), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5, padding=2, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        side = image_size // 4
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * side * side, 120), nn.ReLU(inplace=True),
            nn.Linear(120, 84), nn.ReLU(inplace=True),
            nn.Linear(84, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


@register_model("lenet5")
def lenet5(num_classes: int = 10, in_channels: int = 1, image_size: int = 28) -> nn.Module:
    return LeNet5(num_classes, in_channels, image_size)
