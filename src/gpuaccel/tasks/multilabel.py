"""Multi-label classification: each sample may carry any number of labels (a multi-hot float
target per sample). Binary cross-entropy per label as the loss; F1 over every label decision
(micro), the share of label decisions that are right, and the mean over labels of average
precision.

Average precision needs every score ranked; here each label's scores are counted into
``BINS`` equal bins of probability, positives and negatives apart, summed on the device like
every other metric (one read at the end of an evaluation), and the precision-recall curve is
read off the bins: exact up to ties within a bin (1/256 of probability).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import GpuaccelError
from .base import Metric, Task, _on_device

BINS = 256


class MicroF1(Metric):
    """2 TP / (2 TP + FP + FN) over every (sample, label) decision at ``threshold``."""

    width = 3

    def __init__(self, threshold: float = 0.5):
        self.threshold = threshold

    def sums(self, outputs, targets):
        predicted = torch.sigmoid(outputs.float()) >= self.threshold
        actual = targets >= 0.5
        return torch.stack([(predicted & actual).sum(), (predicted & ~actual).sum(),
                            (~predicted & actual).sum()]).float()

    def finish(self, totals):
        tp, fp, fn = totals
        return 2 * tp / max(2 * tp + fp + fn, 1e-12)


class LabelAccuracy(Metric):
    """The share of (sample, label) decisions at ``threshold`` that are right."""

    def __init__(self, threshold: float = 0.5):
        self.threshold = threshold

    def sums(self, outputs, targets):
        right = ((torch.sigmoid(outputs.float()) >= self.threshold) == (targets >= 0.5)).sum()
        return torch.stack([right.float(), _on_device(targets.numel(), targets)])


class MeanAveragePrecision(Metric):
    """The mean over labels (those with a positive in the evaluation set) of average precision."""

    def __init__(self):
        self.labels: int | None = None  # known at the first batch

    @property
    def width(self) -> int:
        return 0 if self.labels is None else 2 * BINS * self.labels

    def sums(self, outputs, targets):
        self.labels = outputs.shape[-1]
        scores = torch.sigmoid(outputs.float()).reshape(-1, self.labels)
        positive = (targets >= 0.5).reshape(-1, self.labels).float()
        bins = (scores * BINS).long().clamp_(max=BINS - 1)  # (N, L) bin of each score
        counts = torch.zeros(2, self.labels, BINS, device=outputs.device)
        label = torch.arange(self.labels, device=outputs.device).expand_as(bins)
        counts[0].index_put_((label, bins), positive, accumulate=True)
        counts[1].index_put_((label, bins), 1.0 - positive, accumulate=True)
        return counts.flatten()

    def finish(self, totals):
        if not totals:
            return float("nan")
        counts = torch.tensor(totals).view(2, -1, BINS).flip(-1)  # highest scores first
        true_pos, false_pos = counts[0].cumsum(-1), counts[1].cumsum(-1)
        positives = counts[0].sum(-1)
        precision = true_pos / (true_pos + false_pos).clamp_min(1e-12)
        average = (precision * counts[0]).sum(-1) / positives.clamp_min(1e-12)  # precision at each positive
        present = positives > 0
        return float(average[present].mean()) if present.any() else float("nan")


class MultiLabel(Task):
    """Targets are multi-hot floats (N, L) (1 where a label applies); outputs are (N, L) logits,
    one per label."""

    name = "multilabel"
    default_target = "f1"

    def __init__(self, threshold: float = 0.5):
        self.threshold = threshold

    def loss(self, outputs, targets):
        return F.binary_cross_entropy_with_logits(outputs.float(), targets.float())

    def metrics(self):
        return {"f1": MicroF1(self.threshold), "label_accuracy": LabelAccuracy(self.threshold),
                "map": MeanAveragePrecision()}

    NAMED_METRICS = {"f1": MicroF1, "label_accuracy": LabelAccuracy, "map": MeanAveragePrecision}

    def check_batch(self, outputs, targets) -> None:
        if not isinstance(outputs, torch.Tensor) or outputs.shape[1:] != targets.shape[1:]:
            shape = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
            raise GpuaccelError(f"task multilabel takes one logit per label: outputs of the targets' shape "
                                f"{tuple(targets.shape)}, got {shape}")

    def predict(self, logits):
        return torch.sigmoid(logits.float())

    def describe(self):
        return {"name": self.name, "threshold": self.threshold}
