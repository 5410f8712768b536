"""What a user brings from Python meets its task before training starts: models that return an
object with logits (HuggingFace's; one that takes labels is trained on its own loss), multi-hot targets (the multilabel task), metric names beside
a loss function, and one clear error, before any epoch, where targets or outputs do not fit."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gpuaccel
from gpuaccel import GpuaccelError, TrainConfig, Trainer


@dataclass
class SequenceClassifierOutput:
    """The shape of HuggingFace transformers' model outputs: the logits under an attribute."""
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class HuggingFaceStyle(nn.Module):
    def __init__(self, inputs: int, classes: int):
        super().__init__()
        self.score = nn.Linear(inputs, classes)

    def forward(self, input_ids):
        return SequenceClassifierOutput(logits=self.score(input_ids))


def _separable(n: int = 512, features: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return x, x[:, :3].argmax(1)  # three classes a linear model separates


def _config(tmp_path, **settings):
    return TrainConfig(epochs=settings.pop("epochs", 4), batch_size=64, lr=settings.pop("lr", 0.05), monitor=False,
                       run_dir=str(tmp_path / "run"), **settings)


def test_a_model_returning_an_object_with_logits_trains_as_a_classifier(tmp_path):
    x, y = _separable()
    summary = Trainer(_config(tmp_path), model=HuggingFaceStyle(6, 3), train_data={"input_ids": x, "labels": y},
                      task="classification", quiet=True).fit()
    assert summary["metrics"]["accuracy"] > 0.8


class WithOwnLoss(HuggingFaceStyle):
    """Takes the labels and returns its own loss, as HuggingFace's models do: here cross-entropy
    with the first class weighted 10x, which the task's plain cross-entropy is not."""

    def forward(self, input_ids, labels=None):
        logits = self.score(input_ids)
        weights = torch.tensor([10.0, 1.0, 1.0], device=logits.device)
        loss = None if labels is None else F.cross_entropy(logits, labels, weight=weights)
        return SequenceClassifierOutput(logits=logits, loss=loss)


def test_a_model_that_takes_labels_is_trained_on_its_own_loss(tmp_path):
    x, y = _separable()
    data = {"input_ids": x, "labels": y}
    own = Trainer(_config(tmp_path / "own", epochs=1, precision="fp32"), model=WithOwnLoss(6, 3), train_data=data,
                  task="classification", quiet=True)  # (fp32, both: the checks compute in fp32 on a GPU too)
    batch = own.task.split(next(iter(own.train_loader.batches(0))))
    with torch.no_grad():
        logits = own.model.score(batch[0])
        weighted = F.cross_entropy(logits, batch[1], weight=torch.tensor([10., 1, 1], device=logits.device))
    assert own.train_step(*batch).item() == pytest.approx(weighted.item(), rel=1e-5)  # the model's own loss
    # with a loss_fn of the user's, the user's loss is trained on
    mine = Trainer(_config(tmp_path / "mine", epochs=1, precision="fp32"), model=WithOwnLoss(6, 3), train_data=data,
                   loss_fn=F.cross_entropy, quiet=True)
    batch = mine.task.split(next(iter(mine.train_loader.batches(0))))
    with torch.no_grad():
        plain = F.cross_entropy(mine.model.score(batch[0]), batch[1])
    assert mine.train_step(*batch).item() == pytest.approx(plain.item(), rel=1e-5)


def test_multi_hot_targets_train_with_the_multilabel_task(tmp_path):
    x, _ = _separable(1024, 4)
    targets = (x > 0.3).float()  # each of 4 labels on where its feature is high: any number per sample
    summary = Trainer(_config(tmp_path, epochs=8, lr=0.2), model=nn.Linear(4, 4), train_data=(x, targets),
                      task="multilabel", quiet=True).fit()
    metrics = summary["metrics"]
    assert metrics["f1"] > 0.85 and metrics["label_accuracy"] > 0.9 and metrics["map"] > 0.9
    assert summary["main_metric"] == "f1"


def test_the_average_precision_of_perfect_and_reversed_scores():
    from gpuaccel.tasks.multilabel import MeanAveragePrecision

    metric = MeanAveragePrecision()
    targets = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    perfect = metric.finish(metric.sums((targets * 20 - 10), targets).tolist())
    reversed_ = metric.finish(metric.sums((10 - targets * 20), targets).tolist())
    assert perfect == pytest.approx(1.0) and reversed_ < 0.6


@pytest.mark.parametrize("targets, model, message", [
    ("multi-hot", nn.Linear(6, 3), "use task='multilabel' for multi-hot targets"),
    ("out-of-range", nn.Linear(6, 2), "a target label is 2, but the model gives 2 outputs"),
    ("negative", nn.Linear(6, 3), "a target label is -1"),
    ("indices", nn.Sequential(nn.Linear(6, 3), nn.Flatten(0)), r"takes logits \(N, classes\)"),
])
def test_targets_or_outputs_that_do_not_fit_the_task_stop_before_any_epoch(tmp_path, targets, model, message):
    x, y = _separable()
    y = {"multi-hot": F.one_hot(y, 3).float(), "out-of-range": y, "negative": y - 1, "indices": y}[targets]
    with pytest.raises(GpuaccelError, match=message):
        Trainer(_config(tmp_path), model=model, train_data=(x, y), task="classification", quiet=True).fit()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained


def test_metric_names_beside_a_loss_function(tmp_path):
    x, y = _separable()
    summary = Trainer(_config(tmp_path), model=nn.Linear(6, 3), train_data=(x, y), loss_fn=F.cross_entropy,
                      metrics={"accuracy": "accuracy"}, quiet=True).fit()
    assert summary["metrics"]["accuracy"] > 0.8
    with pytest.raises(GpuaccelError, match="no built-in metric named 'f2'"):
        gpuaccel.tasks.CustomTask(F.cross_entropy, {"score": "f2"})
