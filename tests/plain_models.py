"""Models and data for the multi-process tests, and how their worker scripts end. plain_cnn
has no batch norm or dropout: its gradient over a batch split across processes is exactly the
gradient over the whole batch."""

import os
import sys

import torch.nn as nn


def end_worker(code: int = 0) -> None:
    """Ends one of torchrun's worker processes without finalising the interpreter, as
    ``gpuaccel train`` does (cli/train.py): gloo's threads can abort a finalising interpreter
    ("terminate called without an active exception", pytorch/pytorch#179291), which torchrun
    reports as a failed run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def plain_cnn(num_classes: int = 10, in_channels: int = 1, image_size: int = 8) -> nn.Module:
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * image_size * image_size, 32), nn.ReLU(), nn.Linear(32, num_classes))


def bn_cnn(num_classes: int = 10, in_channels: int = 1, image_size: int = 8) -> nn.Module:
    """With batch norm: split into micro-batches, it matches gradient accumulation over the same
    micro-batches (each normalised by its own statistics)."""
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes))


def tiny_resnet(num_classes: int = 10, in_channels: int = 1, image_size: int = 8) -> nn.Module:
    """Two residual stages of one basic block each, 8 channels wide: blocks to checkpoint, fast on a CPU."""
    from gpuaccel.models.resnet import BasicBlock, ResNet

    return ResNet(BasicBlock, (1, 1), num_classes, in_channels, image_size, width=8)


def clicks(n: int = 4096, sizes=(50, 30, 20), seed: int = 0):
    """Click data for DLRM: 13 dense features, one id per table in ``sizes``; the click depends on
    table 0's id and dense feature 0. Returns (dense, sparse, labels)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, 13, generator=g)
    sparse = torch.stack([torch.randint(0, s, (n,), generator=g) for s in sizes], 1)
    liked = torch.rand(sizes[0], generator=g) < 0.5
    return dense, sparse, (liked[sparse[:, 0]] ^ (dense[:, 0] > 1)).float()


def click_task():
    """Binary cross-entropy on the click logit, with accuracy."""
    import torch.nn.functional as F

    from gpuaccel.tasks import CustomTask

    return CustomTask(lambda out, y: F.binary_cross_entropy_with_logits(out, y),
                      metrics={"accuracy": lambda out, y: ((out > 0).float() == y).float().mean()})


class ResidualBlock(nn.Module):
    """x + relu(linear(x)): a unit FSDP and activation checkpointing find by its class name."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + self.linear(x).relu()


def residual_mlp(num_classes: int = 10, in_channels: int = 1, image_size: int = 8) -> nn.Module:
    """Three residual blocks of 1,056 parameters (4,224 bytes) each, no batch norm or dropout."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, 32),
                         *[ResidualBlock(32) for _ in range(3)], nn.Linear(32, num_classes))
