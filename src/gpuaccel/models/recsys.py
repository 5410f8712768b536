"""Rating predictors over (user, item) index pairs; row 0 of every table is the unknown user
or item (data/ratings.py), kept at zero, so a cold start is predicted from what is known.

``matrix_factorization``: the global mean, a bias per user and per item, and the dot
product of a user's and an item's factors (Koren, Bell and Volinsky, 2009).
``neural_mf``: the same biases and factors, plus an MLP over the concatenated user and item
embeddings (He et al.'s NeuMF, 2017, for explicit ratings), summed.

Regularisation is classical matrix factorisation's: each user's and item's factors and bias
are pulled towards zero in proportion to how often they appear in the batches (``l2`` x the
squared norm per rating, added to the gradient), not decayed uniformly as an optimizer's weight
decay would (which over-shrinks the rarely rated and under-shrinks the popular). In evaluation
(and at inference) predictions are clipped to the training ratings' range (``rating_range``;
None for scores, when trained for top-k ranking).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .registry import register_model


class _RowPenalty(torch.autograd.Function):
    """Identity forward; backward adds the gradient of ``strength`` x sum(rows^2) (an L2 penalty
    on exactly the rows the batch used, once per use), without computing the penalty itself."""

    @staticmethod
    def forward(ctx, rows, strength):
        ctx.save_for_backward(rows)
        ctx.strength = strength
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return grad + (2.0 * ctx.strength) * rows, None


def _penalised(rows: torch.Tensor, l2: float, training: bool) -> torch.Tensor:
    if not training or not l2 or not torch.is_grad_enabled():
        return rows
    return _RowPenalty.apply(rows, l2 / rows.shape[0])  # the loss is a mean over the batch: so is the penalty


def _table(rows: int, width: int, std: float) -> nn.Embedding:
    table = nn.Embedding(rows, width)
    nn.init.normal_(table.weight, 0.0, std)
    with torch.no_grad():
        table.weight[0].zero_()  # the unknown user or item: never trained, contributes nothing
    return table


class MatrixFactorization(nn.Module):
    def __init__(self, num_users: int, num_items: int, rating_mean: float, rating_range: tuple[float, float] | None,
                 factors: int = 64, init_std: float = 0.01, mlp: tuple[int, ...] = (), dropout: float = 0.0,
                 l2: float = 0.0):
        super().__init__()
        self.l2 = l2
        self.user_factors, self.item_factors = _table(num_users, factors, init_std), _table(num_items, factors, init_std)
        self.user_bias, self.item_bias = _table(num_users, 1, 0.0), _table(num_items, 1, 0.0)
        self.register_buffer("mean", torch.tensor(float(rating_mean)), persistent=False)
        self.range = None if rating_range is None else tuple(float(v) for v in rating_range)
        layers, width = [], 2 * factors
        for hidden in mlp:
            layers += [nn.Linear(width, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout)]
            width = hidden
        self.mlp = nn.Sequential(*layers, nn.Linear(width, 1)) if mlp else None

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Predicted ratings (or, trained for ranking, scores) of ``users`` for ``items``; items of
        shape (N, C) are C candidates for each user."""
        if items.dim() > users.dim():
            users = users.unsqueeze(-1).expand_as(items)

        def look_up(table, index):
            return _penalised(table(index), self.l2, self.training)

        p, q = look_up(self.user_factors, users), look_up(self.item_factors, items)
        rating = self.mean + look_up(self.user_bias, users)[..., 0] + look_up(self.item_bias, items)[..., 0] \
            + (p * q).sum(-1)
        if self.mlp is not None:
            rating = rating + self.mlp(torch.cat([p, q], -1))[..., 0]
        return rating if self.training or self.range is None else rating.clamp(*self.range)


@register_model("matrix_factorization")
def matrix_factorization(num_users: int, num_items: int, rating_mean: float = 3.5,
                         rating_range: tuple[float, float] | None = (1.0, 5.0), factors: int = 64,
                         init_std: float = 0.01, l2: float = 0.05) -> MatrixFactorization:
    """Biased matrix factorisation: mean + user bias + item bias + user . item factors."""
    return MatrixFactorization(num_users, num_items, rating_mean, rating_range, factors, init_std, l2=l2)


@register_model("neural_mf")
def neural_mf(num_users: int, num_items: int, rating_mean: float = 3.5, rating_range: tuple[float, float] | None = (1.0, 5.0),
              factors: int = 64, init_std: float = 0.01, mlp: tuple[int, ...] = (128, 64),
              dropout: float = 0.1, l2: float = 0.05) -> MatrixFactorization:
    """Biased matrix factorisation plus an MLP over the user and item embeddings (NeuMF)."""
    return MatrixFactorization(num_users, num_items, rating_mean, rating_range, factors, init_std, tuple(mlp),
                               dropout, l2)
