"""Regression: mean squared error as the loss; RMSE and MAE as metrics."""

from __future__ import annotations

import torch.nn.functional as F

from .base import MeanAbsoluteError, MeanSquaredError, Task, _matched


class Regression(Task):
    """Targets are real numbers (any shape); outputs of the same number of elements per sample."""

    name = "regression"
    default_target = "rmse"

    def loss(self, outputs, targets):
        return F.mse_loss(*_matched(outputs, targets))

    NAMED_METRICS = {"rmse": lambda: MeanSquaredError(root=True), "mse": MeanSquaredError, "mae": MeanAbsoluteError}

    def metrics(self):
        return {"rmse": MeanSquaredError(root=True), "mae": MeanAbsoluteError()}
