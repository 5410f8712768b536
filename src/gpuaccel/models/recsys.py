"""Rating predictors over (user, item) index pairs; row 0 of every table is the unknown user
or item (data/ratings.py), kept at zero, so a cold start is predicted from what is known.

``matrix_factorization``: the global mean, a bias per user and per item, and the dot
product of a user's and an item's factors (Koren, Bell and Volinsky, 2009).
``neural_mf``: the same biases and factors, plus an MLP over the concatenated user and item
embeddings (He et al.'s NeuMF, 2017, for explicit ratings), summed.
``autorec``: item-based AutoRec (Sedhain et al., 2015): each item's column of the training
ratings (one entry per user, 0 where unrated) encoded through one sigmoid layer and decoded
back, the decoded entry being the predicted rating; ensembled with a biased matrix
factorisation, the two fitted side by side and their predictions averaged (their errors
differ enough for the average to beat both).

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
import torch.nn.functional as F

from ..errors import GpuaccelError
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


class SideEmbeddings(nn.Module):
    """One side's features (data/ratings.py's ``read_side_features``), looked up by index: an
    embedding per categorical feature (codes from 1; 0 = not known), a bias-free linear map per
    multi-hot one (genres: the sum of its genres' vectors), concatenated. The feature tables are
    model arguments, so they are buffers that a saved model need not repeat."""

    def __init__(self, features: dict[str, list], width: int):
        super().__init__()
        self.names = sorted(features)
        for name in self.names:
            table = torch.tensor(features[name])
            self.register_buffer(f"{name}_table", table.float() if table.dim() > 1 else table.long(), persistent=False)
            self.add_module(name, nn.Linear(table.shape[1], width, bias=False) if table.dim() > 1
                            else _table(int(table.max()) + 1, width, 0.01))
        self.width = width * len(self.names)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return torch.cat([getattr(self, name)(getattr(self, f"{name}_table")[index]) for name in self.names], -1)


class MatrixFactorization(nn.Module):
    def __init__(self, num_users: int, num_items: int, rating_mean: float, rating_range: tuple[float, float] | None,
                 factors: int = 64, init_std: float = 0.01, mlp: tuple[int, ...] = (), dropout: float = 0.0,
                 l2: float = 0.0, user_features: dict | None = None, item_features: dict | None = None,
                 side_width: int = 8):
        super().__init__()
        self.l2 = l2
        self.user_factors, self.item_factors = _table(num_users, factors, init_std), _table(num_items, factors, init_std)
        self.user_bias, self.item_bias = _table(num_users, 1, 0.0), _table(num_items, 1, 0.0)
        self.register_buffer("mean", torch.tensor(float(rating_mean)), persistent=False)
        self.range = None if rating_range is None else tuple(float(v) for v in rating_range)
        # side features feed the MLP (there is none without one): the users' and the items'
        self.user_side = SideEmbeddings(user_features, side_width) if mlp and user_features else None
        self.item_side = SideEmbeddings(item_features, side_width) if mlp and item_features else None
        layers, width = [], 2 * factors + sum(side.width for side in (self.user_side, self.item_side) if side)
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
            parts = [p, q] + [side(index) for side, index in ((self.user_side, users), (self.item_side, items)) if side]
            rating = rating + self.mlp(torch.cat(parts, -1))[..., 0]
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
              dropout: float = 0.1, l2: float = 0.05, user_features: dict | None = None,
              item_features: dict | None = None, side_features: bool = True, side_width: int = 8) -> MatrixFactorization:
    """Biased matrix factorisation plus an MLP over the user and item embeddings (NeuMF) and,
    where the data has them and ``side_features`` is on, embeddings of the users' and items'
    side features (age group, gender, occupation; genres, decade)."""
    if not side_features:
        user_features = item_features = None
    return MatrixFactorization(num_users, num_items, rating_mean, rating_range, factors, init_std, tuple(mlp),
                               dropout, l2, user_features, item_features, side_width)


class AutoRec(nn.Module):
    """Item-based AutoRec over the training ratings, which ``data_init`` (called by the trainer
    with the training triples) stores as a persistent buffer, so a saved or exported model
    carries what it predicts from. Every forward decodes all items at once: a fixed-shape pair
    of matrix products, cheaper than gathering each batch's items and capturable as one CUDA
    graph. The recipe feeds every training rating as one batch, AutoRec's full-batch objective.

    With ``mf_weight`` > 0 a biased matrix factorisation is a second member: in training the
    forward returns both members' predictions, (N, 2), each fitted to the ratings on its own
    (tasks/regression.py); in evaluation their ``mf_weight``-weighted average. The factorisation
    learns at ``mf_lr_scale`` times the rate (it needs more than the autoencoder's full-batch
    steps give at one rate). Penalties follow AutoRec: ``l2`` x the squared weights against the
    sum of squared errors, added to the gradient like models of this file do."""

    def __init__(self, num_users: int, num_items: int, rating_mean: float, rating_range: tuple[float, float],
                 hidden: int = 500, l2: float = 100.0, mf_weight: float = 0.25, mf_factors: int = 64,
                 mf_l2: float = 0.1, mf_lr_scale: float = 10.0):
        super().__init__()
        if num_users * num_items > 2 ** 28:
            raise GpuaccelError(f"autorec keeps the {num_items - 1:,} x {num_users - 1:,} ratings matrix dense "
                                f"(over 1 GiB); use matrix_factorization or neural_mf for data this large")
        self.members = 2 if mf_weight > 0 else 1
        self.l2, self.mf_weight = l2, mf_weight
        self.encode, self.decode = nn.Linear(num_users, hidden), nn.Linear(hidden, num_users)
        self.register_buffer("ratings", torch.zeros(num_items, num_users))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))  # training ratings: the penalty's scale
        self.register_buffer("mean", torch.tensor(float(rating_mean)), persistent=False)
        self.range = tuple(float(v) for v in rating_range)
        # (the members share the gradient of one mean loss: each penalty is divided as the loss is)
        self.factorization = MatrixFactorization(num_users, num_items, rating_mean, None, mf_factors,
                                                 l2=mf_l2 / self.members) if mf_weight > 0 else None
        if self.factorization is not None:
            for p in self.factorization.parameters():
                p.lr_scale = mf_lr_scale

    @torch.no_grad()
    def data_init(self, users: torch.Tensor, items: torch.Tensor, ratings: torch.Tensor) -> None:
        self.ratings.zero_()
        self.ratings[items.to(self.ratings.device), users.to(self.ratings.device)] = ratings.to(self.ratings)
        self.count.fill_(len(ratings))

    def _weights(self, layer: nn.Linear) -> torch.Tensor:
        if not self.training or not torch.is_grad_enabled() or not self.l2:
            return layer.weight
        return _RowPenalty.apply(layer.weight, self.l2 / (2 * self.members * self.count.clamp_min(1)))

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        if items.dim() > users.dim():
            users = users.unsqueeze(-1).expand_as(items)
        hidden = torch.sigmoid(F.linear(self.ratings, self._weights(self.encode), self.encode.bias))
        decoded = F.linear(hidden, self._weights(self.decode), self.decode.bias)  # (items, users)
        rating = decoded[items, users]
        if self.factorization is None:
            return rating if self.training else torch.where((users == 0) | (items == 0), self.mean,
                                                            rating).clamp(*self.range)
        factorized = self.factorization(users, items)
        if self.training:
            return torch.stack([rating, factorized], -1)
        # a user or item the training ratings never saw: the factorisation's biases alone know it
        rating = torch.where((users == 0) | (items == 0), factorized, rating.clamp(*self.range))
        return torch.lerp(rating, factorized.clamp(*self.range), self.mf_weight)


@register_model("autorec")
def autorec(num_users: int, num_items: int, rating_mean: float = 3.5,
            rating_range: tuple[float, float] | None = (1.0, 5.0), hidden: int = 500, l2: float = 100.0,
            mf_weight: float = 0.25, mf_factors: int = 64, mf_l2: float = 0.1, mf_lr_scale: float = 10.0) -> AutoRec:
    """Item-based AutoRec, averaged with a biased matrix factorisation (``mf_weight``; 0: alone)."""
    if rating_range is None:
        raise GpuaccelError("autorec predicts ratings; for --task ranking use matrix_factorization or neural_mf")
    return AutoRec(num_users, num_items, rating_mean, rating_range, hidden, l2, mf_weight, mf_factors, mf_l2,
                   mf_lr_scale)
