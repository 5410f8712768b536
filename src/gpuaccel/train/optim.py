"""Optimizers and learning-rate schedules, from PyTorch's own implementations."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .config import TrainConfig


def build_optimizer(model: nn.Module, config: TrainConfig, device: torch.device,
                    fused: bool = True) -> torch.optim.Optimizer:
    """Weight decay applies to weights only: decaying batch-norm scales and biases hurts accuracy.
    Those also take ``bias_lr_scale`` times the learning rate. ``fused``: one fused kernel per
    step on a GPU (sharded parameters use the multi-tensor path instead)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim > 1 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay, "lr": config.lr},
              {"params": no_decay, "weight_decay": 0.0, "lr": config.lr * config.bias_lr_scale}]
    fused = {"fused": True} if (fused and device.type == "cuda") else {}
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=(config.momentum, 0.999), **fused)
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum,
                           nesterov=config.nesterov and config.momentum > 0, **fused)


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, steps_per_epoch: int):
    """A ``LambdaLR`` stepped once per optimizer step; ``warmup_epochs`` sets the rising part.

    onecycle: linear from lr/10 up to lr, then linear down to lr/1000. cosine: linear warm-up
    from 0, then cosine to 0. constant: linear warm-up, then lr. The factor is computed from
    the config, so a resumed run given more epochs stretches its schedule to the new length.
    """
    total = max(1, config.epochs * steps_per_epoch)
    warmup = min(max(total - 1, 0), int(round(config.warmup_epochs * steps_per_epoch)))

    def factor(step: int) -> float:
        if config.schedule == "onecycle":
            if step < warmup:
                return 0.1 + 0.9 * step / warmup
            return max(1e-3, 1.0 - (1.0 - 1e-3) * (step - warmup) / max(1, total - warmup))
        if step < warmup:
            return (step + 1) / warmup
        if config.schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
