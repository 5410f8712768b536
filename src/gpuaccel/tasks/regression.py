"""Regression: mean squared error as the loss; RMSE and MAE as metrics."""

from __future__ import annotations

import torch.nn.functional as F

from .base import MeanAbsoluteError, MeanSquaredError, Task, _matched


class Regression(Task):
    """Targets are real numbers (any shape); outputs of the same number of elements per sample."""

    name = "regression"
    default_target = "rmse"

    def loss(self, outputs, targets):
        if outputs.dim() == targets.dim() + 1 and outputs.shape[:-1] == targets.shape and outputs.shape[-1] > 1:
            # (N, K) outputs against (N,) targets: an ensemble's K members, each fitted to the targets
            # on its own (e.g. models/recsys.py's autorec in training)
            targets = targets.unsqueeze(-1).expand_as(outputs)
        return F.mse_loss(*_matched(outputs, targets))

    NAMED_METRICS = {"rmse": lambda: MeanSquaredError(root=True), "mse": MeanSquaredError, "mae": MeanAbsoluteError}

    def metrics(self):
        return {"rmse": MeanSquaredError(root=True), "mae": MeanAbsoluteError()}
