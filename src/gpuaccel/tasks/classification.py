"""Image classification: cross-entropy (with optional label smoothing), top-1 accuracy, and
test-time augmentation (the mirror image and one-pixel translations) at evaluation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import GpuaccelError
from .base import Accuracy, Task


class Classification(Task):
    """Targets are class indices; outputs are logits with the classes in dimension 1 (so
    per-position labels, e.g. (N, H, W) against (N, C, H, W) logits, work as they are)."""

    name = "classification"
    default_target = "accuracy"

    def __init__(self, label_smoothing: float = 0.0, tta: int = 0):
        if tta not in (0, 1, 2):
            raise GpuaccelError(f"--tta must be 0 (none), 1 (flip) or 2 (flip and translate), got {tta}")
        self.label_smoothing, self.tta = label_smoothing, tta

    def loss(self, outputs, targets):
        return F.cross_entropy(outputs, targets, label_smoothing=self.label_smoothing)

    def eval_loss_sum(self, outputs, targets):
        # plain cross-entropy (no smoothing) per sample, summed: what "test loss" has always meant
        losses = F.cross_entropy(outputs.float(), targets, reduction="none")
        return losses.sum() / (losses.numel() / targets.shape[0])

    NAMED_METRICS = {"accuracy": Accuracy}

    def check_batch(self, outputs, targets) -> None:
        if not isinstance(outputs, torch.Tensor) or outputs.dim() < 2:
            got = f"a tensor of shape {tuple(outputs.shape)}" if isinstance(outputs, torch.Tensor) \
                else f"a {type(outputs).__name__}"
            raise GpuaccelError(f"task classification takes logits (N, classes) from the model; it returned {got}")
        if targets.is_floating_point():
            hint = "task='multilabel' for multi-hot targets" if targets.shape[1:] == outputs.shape[1:] else \
                "integer class indices (torch.long)"
            raise GpuaccelError(f"task classification takes integer class indices as targets, got {targets.dtype} "
                                f"of shape {tuple(targets.shape)}; use {hint}")
        if targets.dim() != outputs.dim() - 1:
            hint = "; squeeze the last dimension" if targets.dim() == outputs.dim() and targets.shape[-1] == 1 else ""
            want = ", ".join(["N", *map(str, outputs.shape[2:])]) if outputs.dim() > 2 else "N,"
            got = ", ".join(["N", *map(str, outputs.shape[1:])])
            raise GpuaccelError(f"task classification takes one class index per sample: the model's outputs "
                                f"({got}) take targets ({want}), not targets of shape {tuple(targets.shape)}{hint}")
        classes = outputs.shape[1]
        low, high = int(targets.min()), int(targets.max())  # (once, before training)
        if low < 0 or high >= classes:
            raise GpuaccelError(f"a target label is {low if low < 0 else high}, but the model gives {classes} "
                                f"outputs (labels 0..{classes - 1}); give the model one output per class")

    def metrics(self):
        return {"accuracy": Accuracy()}

    def eval_outputs(self, call, images):
        """Mean logits over the image, its mirror (tta >= 1) and one-pixel translations of both
        (tta 2, half weight each)."""
        logits = call(images)
        if self.tta == 0:
            return logits
        flipped = images.flip(-1)
        logits = logits + call(flipped)
        if self.tta == 1:
            return logits / 2
        padded = [F.pad(x, (1, 1, 1, 1), mode="reflect") for x in (images, flipped)]
        h, w = images.shape[2:]
        layout = torch.channels_last if images.is_contiguous(memory_format=torch.channels_last) and \
            not images.is_contiguous() else torch.contiguous_format
        for x in padded:
            for dy, dx in ((0, 0), (2, 2)):
                # a contiguous copy has the strides of a normal batch: no recompilation
                shifted = x[:, :, dy:dy + h, dx:dx + w].contiguous(memory_format=layout)
                logits = logits + 0.5 * call(shifted)
        return logits / 4

    def predict(self, logits):
        return torch.softmax(logits.float(), 1)

    def describe(self):
        return {"name": self.name, "label_smoothing": self.label_smoothing, "tta": self.tta}
