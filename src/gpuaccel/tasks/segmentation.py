"""Semantic segmentation: a class for every pixel.

Targets are (N, H, W) masks of class indices (0 the background, 255 not scored); the model
returns (N, K, H, W) logits, K counting the background. The loss is cross-entropy plus the soft
Dice loss (1 - Dice averaged over the classes present in the batch), which keeps small objects
from drowning in background pixels. Metrics: ``miou`` (intersection over union per class, over
the classes present in the evaluation set's masks or predictions, background included, as
Pascal VOC and Cityscapes report it) and ``pixel_accuracy``, from one confusion matrix summed on
the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import GpuaccelError
from .base import Metric, Task

IGNORE = 255


class ConfusionMatrix(Metric):
    """Counts of (true class, predicted class) over the scored pixels; ``finish`` reads one number off it."""

    def __init__(self, num_classes: int, which: str = "miou"):
        self.num_classes, self.which = num_classes, which
        self.width = num_classes * num_classes

    def sums(self, outputs, targets):
        k = self.num_classes
        predicted = outputs.argmax(1).flatten()
        truth = targets.long().flatten()
        scored = truth != IGNORE
        pairs = torch.where(scored, truth * k + predicted, k * k)  # (unscored pixels to a bin dropped below)
        # (index_add_ rather than bincount, which reads its input's maximum on the host)
        counts = torch.zeros(k * k + 1, dtype=torch.long, device=pairs.device).index_add_(0, pairs, torch.ones_like(pairs))
        return counts[:k * k].float()

    def finish(self, totals):
        matrix = torch.tensor(totals, dtype=torch.float64).view(self.num_classes, self.num_classes)
        if self.which == "pixel_accuracy":
            return float(matrix.diagonal().sum() / matrix.sum().clamp_min(1))
        inter = matrix.diagonal()
        union = matrix.sum(0) + matrix.sum(1) - inter
        present = union > 0
        return float((inter[present] / union[present]).mean()) if present.any() else float("nan")


class Segmentation(Task):
    """``num_classes`` counts the background (class 0)."""

    name = "segmentation"
    default_target = "miou"
    compile_loss = True  # (eager: about 20 kernels over logits of every pixel and class, forward and backward)

    def __init__(self, num_classes: int, dice_weight: float = 1.0, tta: int = 0):
        if tta not in (0, 1):
            raise GpuaccelError(f"segmentation's --tta is 0 (none) or 1 (the mirror image too), got {tta}")
        self.num_classes, self.dice_weight, self.tta = num_classes, dice_weight, tta

    def loss(self, outputs, targets):
        outputs, targets = outputs.float(), targets.long()
        loss = F.cross_entropy(outputs, targets, ignore_index=IGNORE)
        if self.dice_weight:
            scored = (targets != IGNORE)[:, None]
            probs = outputs.softmax(1) * scored
            truth = F.one_hot(torch.where(scored[:, 0], targets, 0), self.num_classes).permute(0, 3, 1, 2) * scored
            inter = (probs * truth).sum((0, 2, 3))
            total = probs.sum((0, 2, 3)) + truth.sum((0, 2, 3))
            present = truth.sum((0, 2, 3)) > 0
            dice = (2 * inter + 1) / (total + 1)
            loss = loss + self.dice_weight * ((1 - dice) * present).sum() / present.sum().clamp_min(1)
        return loss

    def metrics(self):
        return {"miou": ConfusionMatrix(self.num_classes, "miou"),
                "pixel_accuracy": ConfusionMatrix(self.num_classes, "pixel_accuracy")}

    def eval_outputs(self, call, images):
        """With tta 1, the mean of the logits of the image and (mirrored back) of its mirror image."""
        logits = call(images)
        if self.tta == 0:
            return logits
        return (logits + call(images.flip(-1)).flip(-1)) / 2

    def predict(self, outputs):
        """(N, H, W) class indices."""
        return outputs.argmax(1)

    def check_batch(self, outputs, targets) -> None:
        if not isinstance(outputs, torch.Tensor) or outputs.dim() != 4 or outputs.shape[1] != self.num_classes \
                or outputs.shape[2:] != targets.shape[1:]:
            shape = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
            raise GpuaccelError(f"task segmentation takes logits (N, {self.num_classes}, H, W) at the masks' size "
                                f"{tuple(targets.shape[1:])}; the model returned {shape}")
        highest = int(targets[targets != IGNORE].max()) if (targets != IGNORE).any() else 0
        if highest >= self.num_classes:
            raise GpuaccelError(f"a mask has class {highest}; the task has {self.num_classes} classes (background "
                                f"included)")

    def describe(self):
        return {"name": self.name, "num_classes": self.num_classes, "tta": self.tta}

