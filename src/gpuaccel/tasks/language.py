"""Language modelling: next-token cross-entropy over every position of a window; perplexity
and next-token accuracy at evaluation. The held-out loss is the usual "validation loss"
(nats per token), and ``--target val_loss=1.47`` stops a run there."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .base import Accuracy, Metric, Task, _on_device


class Perplexity(Metric):
    """exp of the mean next-token cross-entropy over every evaluated position."""

    higher_is_better = False

    def sums(self, logits, targets):
        total = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="sum")
        return torch.stack([total, _on_device(targets.numel(), targets)])

    def finish(self, totals):
        return math.exp(min(super().finish(totals), 700.0))


class LanguageModelling(Task):
    """Inputs are token ids (batch, time); outputs are logits (batch, time, vocabulary); targets
    the next token at each position."""

    name = "language_modelling"
    default_target = "loss"
    # eager, the float32 copy of the logits and the cross-entropy's kernels forward and backward
    # held GPT-2 small (20k tokens) at 0.944x nanoGPT's tokens/s, compiled 1.023x (docs/results.md)
    compile_loss = True

    def loss(self, logits, targets):
        # in float32: a bf16 loss is rounded to steps of 1/128 near 1.5, coarser than the
        # differences a validation loss is compared by
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())

    NAMED_METRICS = {"perplexity": Perplexity, "accuracy": lambda: Accuracy(class_dim=-1)}

    def metrics(self):
        return {"perplexity": Perplexity(), "accuracy": Accuracy(class_dim=-1)}

    def example_input(self, batch, sample_shape):
        return torch.zeros(batch, *sample_shape, dtype=torch.long)
