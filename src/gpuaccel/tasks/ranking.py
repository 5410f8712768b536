"""Top-k recommendation from implicit feedback, evaluated as the neural-collaborative-filtering
papers do (He et al., 2017): each user's held-out item is ranked among sampled items the user
never interacted with; HR@k is the share of users whose held-out item is in the top k, NDCG@k
rewards it by 1 / log2(position + 2).

Training outputs are scores (logits) of (user, item) pairs against 1 (interacted) or 0 (a
sampled negative), with binary cross-entropy. At evaluation the outputs are (users, candidates)
scores whose column 0 is the held-out item (the targets say which column)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Metric, Task, _on_device


def _rank_of_target(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """How many candidates score above each row's target item (0: it is first). Ties count
    against the target, so a constant scorer ranks it last rather than first."""
    target_score = outputs.float().gather(1, targets.view(-1, 1))
    others = torch.ones_like(outputs, dtype=torch.bool).scatter_(1, targets.view(-1, 1), False)
    return ((outputs.float() >= target_score) & others).sum(1)


class _AtK(Metric):
    def __init__(self, k: int = 10):
        self.k = k


class HitRate(_AtK):
    def sums(self, outputs, targets):
        hits = (_rank_of_target(outputs, targets) < self.k).sum().float()
        return torch.stack([hits, _on_device(targets.numel(), hits)])


class NDCG(_AtK):
    def sums(self, outputs, targets):
        rank = _rank_of_target(outputs, targets).float()
        gain = torch.where(rank < self.k, 1.0 / torch.log2(rank + 2.0), torch.zeros_like(rank)).sum()
        return torch.stack([gain, _on_device(targets.numel(), gain)])


class Ranking(Task):
    name = "ranking"

    def __init__(self, k: int = 10):
        self.k = k
        self.default_target = f"hr@{k}"

    def loss(self, outputs, targets):
        return F.binary_cross_entropy_with_logits(outputs.float(), targets.float())

    def eval_loss_sum(self, outputs, targets):
        # each row: the target item against its negatives, binary cross-entropy averaged over the row
        labels = torch.zeros_like(outputs, dtype=torch.float32).scatter_(1, targets.view(-1, 1), 1.0)
        return F.binary_cross_entropy_with_logits(outputs.float(), labels, reduction="none").mean(1).sum()

    def metrics(self):
        return {f"hr@{self.k}": HitRate(self.k), f"ndcg@{self.k}": NDCG(self.k)}

    def predict(self, outputs):
        return torch.sigmoid(outputs.float())

    def describe(self):
        return {"name": self.name, "k": self.k}
