"""A DLRM-style click-through model (Naumov et al., 2019) with its embedding tables updated
inside the backward pass.

Inputs: dense features (N, D) float and sparse features (N, T) int64, one id per table.
Dense features go through the bottom MLP; each sparse feature looks up its table; the
pairwise dot products of all T + 1 vectors, with the bottom MLP's output, go through the top
MLP to one logit.

``FusedEmbeddingTables`` keeps every table in one weight matrix (table t's rows start at
``offsets[t]``): a batch's lookups are one gather. Tables of millions of rows would need
gigabytes of optimizer state and a dense gradient each step under AdamW, so, as FBGEMM's
table-batched embeddings do for DLRM, the optimizer is fused into the backward pass: the rows
the batch used are updated in place with row-wise Adagrad (one accumulator per row), at the
tables' own learning rate. The weight has no ``.grad`` and gpuaccel's optimizer leaves it
alone (``updated_in_backward``). Duplicated ids in a batch sum their gradients first, in a
table-sized fp32 buffer of which each step touches only the used rows (it doubles the tables'
memory; a sort-based sum would not, at the cost of a sort). Every
step is a fixed sequence of kernels (no data-dependent sizes), so the step graph can capture it.

Under data parallel every process holds the whole tables (``parallel/data_parallel.py`` sets
``process_group``): before the update, each process gathers every process's rows and
gradients, so all replicas take the same step, the one a single process with the whole batch
would take. That moves world x batch x tables x dim gradient values per step (in the dtype the
model computes in: bf16 under autocast): cheap for batches of MovieLens size, the price of
replication for Criteo-sized ones. Sharding the tables across GPUs (TorchRec's model parallel)
is not built.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from .layers import eager_forward
from .registry import register_model


# torch 2.13 renamed all_gather_into_tensor (and deprecated the old name); 2.11 has only that
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _FusedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, module, dtype):
        ctx.save_for_backward(ids)
        ctx.module = module
        return weight[ids].to(dtype)  # cast here: the gradient comes back in ``dtype`` (half the bytes to gather)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        ctx.module.apply_gradient(ids.reshape(-1), grad.reshape(-1, grad.shape[-1]))
        return None, None, None, None


@eager_forward  # an update inside the backward pass is not for inductor; the step graph captures it
class FusedEmbeddingTables(nn.Module):
    def __init__(self, sizes: list[int], dim: int, lr: float = 0.05, eps: float = 1e-8):
        super().__init__()
        self.sizes, self.lr, self.eps = list(sizes), lr, eps
        self.register_buffer("offsets", torch.tensor([0, *sizes[:-1]]).cumsum(0), persistent=False)
        total = sum(sizes)
        self.weight = nn.Parameter(torch.empty(total, dim))
        self.weight.updated_in_backward = True  # (train/optim.py leaves it out of the optimizer)
        # each table initialised as DLRM does: uniform in +-1/sqrt(rows)
        with torch.no_grad():
            for start, rows in zip(self.offsets.tolist(), sizes):
                self.weight[start:start + rows].uniform_(-1 / math.sqrt(rows), 1 / math.sqrt(rows))
        self.register_buffer("accumulator", torch.zeros(total))  # row-wise Adagrad's sum of mean squared gradients
        self._summed: torch.Tensor | None = None  # per-row gradient sums: allocated once, zero between steps
        self.process_group = None  # data parallel: the processes whose batches' updates every replica takes

    def forward(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """(N, T) ids, one per table -> (N, T, dim) rows, in ``dtype`` (default: the tables')."""
        rows, dtype = ids + self.offsets, dtype or self.weight.dtype
        if self.training and torch.is_grad_enabled():
            return _FusedLookup.apply(rows, self.weight, self, dtype)
        return self.weight[rows].to(dtype)

    @torch.no_grad()
    def apply_gradient(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        if self.process_group is not None:
            rows, grad = self._gathered(rows, grad)
        if self._summed is None or self._summed.device != grad.device:
            self._summed = torch.zeros(self.weight.shape, dtype=torch.float32, device=grad.device)
        self._summed.index_add_(0, rows, grad.float())  # duplicates add up here
        summed = self._summed[rows]  # every occurrence of a row reads the same sum ...
        accumulated = self.accumulator[rows] + summed.square().mean(1)
        # ... so every write of a duplicated row writes the same value: the update happens once
        self.accumulator.index_put_((rows,), accumulated)
        step = summed * (self.lr / (accumulated.sqrt() + self.eps)).unsqueeze(1)
        self.weight.index_put_((rows,), self.weight[rows] - step.to(self.weight.dtype))
        self._summed.index_fill_(0, rows, 0.0)

    def _gathered(self, rows: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every process's rows and gradients (fixed sizes: each process has the same batch). Each
        gradient is of its process's mean loss; over the whole batch that is 1 / world of it."""
        world = dist.get_world_size(self.process_group)
        all_rows = rows.new_empty(world * rows.numel())
        _all_gather(all_rows, rows.contiguous(), group=self.process_group)
        grad = grad.contiguous()
        all_grad = grad.new_empty(world * grad.shape[0], grad.shape[1])
        _all_gather(all_grad, grad, group=self.process_group)
        return all_rows, all_grad.float().div_(world)


def _mlp(sizes: list[int], last_activation: bool) -> nn.Sequential:
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_activation:
            layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, dense_features: int, table_sizes: list[int], dim: int, bottom: list[int], top: list[int],
                 table_lr: float):
        super().__init__()
        self.tables = FusedEmbeddingTables(table_sizes, dim, table_lr)
        self.bottom = _mlp([dense_features, *bottom, dim], last_activation=True)
        vectors = len(table_sizes) + 1
        self.register_buffer("pairs", torch.triu_indices(vectors, vectors, 1), persistent=False)
        self.top = _mlp([dim + vectors * (vectors - 1) // 2, *top, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.cat([x.unsqueeze(1), self.tables(sparse, x.dtype)], 1)  # (N, T + 1, dim)
        products = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, products], 1))[:, 0]


@register_model("dlrm")
def dlrm(dense_features: int = 13, table_sizes: tuple[int, ...] = (1000,) * 26, dim: int = 128,
         bottom: tuple[int, ...] = (512, 256), top: tuple[int, ...] = (1024, 1024, 512, 256),
         table_lr: float = 0.05) -> DLRM:
    """DLRM: bottom MLP for dense features, fused embedding tables for sparse ones, pairwise dot
    interactions, top MLP to one click logit (MLPerf's Criteo sizes by default, tables aside)."""
    return DLRM(dense_features, list(table_sizes), dim, list(bottom), list(top), table_lr)
