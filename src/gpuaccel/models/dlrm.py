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

Under data parallel (``parallel/data_parallel.py``) the tables are shared one of two ways, and
either way every process takes the step one process with the whole batch would take:

- replicated (``process_group``; the Accelerator's way): every process holds the whole
  tables and, before the update, gathers every process's rows and gradients. That moves
  world x batch x tables x dim values per step and applies all of them on every process:
  cheap at MovieLens sizes, the price of replication at Criteo's.
- column-sharded (``shard_columns``; Trainer's way, where the width divides by the process
  count): each process holds dim / world columns of every row (TorchRec's column-wise
  sharding). The forward pass gathers every process's ids (world x batch x tables ids),
  looks up its columns of all of them and sends each process its own samples' part (one
  all-to-all of batch x tables x dim values, in the compute dtype); the backward pass sends
  the gradients back the same way, and each process updates its columns of every looked-up
  row. Row-wise Adagrad's per-row mean square needs the whole row: one all-reduce of one
  value per looked-up row. Per process: 1 / world of the replicated way's update work and of
  the tables' memory; by count of the values moved, as many bytes on 2 processes, about half
  on 4. Every size is fixed (the step graph captures it); evaluation, whose batches may differ
  between processes, pads them to the largest. ``state_dict()`` gathers the whole tables (a
  collective: every process calls it), and loading a whole table keeps this process's columns.
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


class _ShardedLookup(torch.autograd.Function):
    """Column-sharded tables: every process's ids in, this process's samples' whole rows out."""

    @staticmethod
    def forward(ctx, rows, weight, module, dtype):
        everyone = module._all_rows(rows)
        ctx.save_for_backward(everyone)
        ctx.module = module
        return module._exchanged_rows(weight, everyone, rows.shape, dtype)

    @staticmethod
    def backward(ctx, grad):
        (everyone,) = ctx.saved_tensors
        module = ctx.module
        world, width = module.column_world, module.weight.shape[1]
        # (samples, world, width) -> block j: this process's samples' gradient for process j's columns
        mine = module._all_to_all(grad.reshape(-1, world, width).transpose(0, 1))
        module.apply_gradient(everyone, mine.reshape(-1, width))
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
        self.process_group = None  # replicated data parallel: the processes whose updates every replica takes
        self.column_group, self.column_world = None, 1  # column-sharded: the processes holding the other columns
        self.register_state_dict_post_hook(_whole_tables)
        self.register_load_state_dict_pre_hook(_own_columns)

    def forward(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """(N, T) ids, one per table -> (N, T, dim) rows, in ``dtype`` (default: the tables')."""
        rows, dtype = ids + self.offsets, dtype or self.weight.dtype
        training = self.training and torch.is_grad_enabled()
        if self.column_group is not None:
            if training:  # (every process's batch has the same size)
                return _ShardedLookup.apply(rows, self.weight, self, dtype)
            return self._evaluation_rows(rows, dtype)
        if training:
            return _FusedLookup.apply(rows, self.weight, self, dtype)
        return self.weight[rows].to(dtype)

    # ------------------------------------------------------------------ column sharding

    def shard_columns(self, group) -> bool:
        """Keeps this process's dim / world columns of every row (the tables must be the same on
        every process already); False, and nothing changes, where dim does not divide."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        dim = self.weight.shape[1]
        if world < 2 or dim % world:
            return False
        width = dim // world
        self.weight = nn.Parameter(self.weight.detach()[:, rank * width:(rank + 1) * width].clone())
        self.weight.updated_in_backward = True
        self.column_group, self.column_world, self._summed = group, world, None
        return True

    def _all_to_all(self, blocks: torch.Tensor) -> torch.Tensor:
        """(world, n, width) blocks, block j to process j -> block i from process i."""
        blocks = blocks.contiguous()
        received = torch.empty_like(blocks)
        dist.all_to_all_single(received, blocks, group=self.column_group)
        return received

    def _all_rows(self, rows: torch.Tensor) -> torch.Tensor:
        everyone = rows.new_empty(self.column_world * rows.numel())
        _all_gather(everyone, rows.reshape(-1).contiguous(), group=self.column_group)
        return everyone

    def _exchanged_rows(self, weight, everyone, shape, dtype) -> torch.Tensor:
        """This process's columns of every process's rows, exchanged for every process's
        columns of this process's rows: (*shape, dim)."""
        world = self.column_world
        received = self._all_to_all(weight[everyone].to(dtype).view(world, -1, weight.shape[1]))
        return received.transpose(0, 1).reshape(*shape, world * weight.shape[1])  # columns in process order

    def _evaluation_rows(self, rows: torch.Tensor, dtype) -> torch.Tensor:
        """As in training, each process's batch padded to the largest (evaluation's batches may
        differ in size between processes; this costs a host synchronisation)."""
        count = torch.tensor([rows.shape[0]], device=rows.device)
        counts = count.new_empty(self.column_world)
        _all_gather(counts, count, group=self.column_group)
        largest = int(counts.max())
        padded = torch.cat([rows, rows.new_zeros(largest - rows.shape[0], *rows.shape[1:])])
        out = self._exchanged_rows(self.weight, self._all_rows(padded), padded.shape, dtype)
        return out[:rows.shape[0]]

    # ------------------------------------------------------------------ the update

    @torch.no_grad()
    def apply_gradient(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        if self.process_group is not None:
            rows, grad = self._gathered(rows, grad)
        elif self.column_group is not None:  # every process's rows; its mean loss is 1 / world of the whole batch's
            grad = grad.float().div_(self.column_world)
        if self._summed is None or self._summed.device != grad.device:
            self._summed = torch.zeros(self.weight.shape, dtype=torch.float32, device=grad.device)
        self._summed.index_add_(0, rows, grad.float())  # duplicates add up here
        summed = self._summed[rows]  # every occurrence of a row reads the same sum ...
        accumulated = self.accumulator[rows] + self._mean_square(summed)
        # ... so every write of a duplicated row writes the same value: the update happens once
        self.accumulator.index_put_((rows,), accumulated)
        step = summed * (self.lr / (accumulated.sqrt() + self.eps)).unsqueeze(1)
        self.weight.index_put_((rows,), self.weight[rows] - step.to(self.weight.dtype))
        self._summed.index_fill_(0, rows, 0.0)

    def _mean_square(self, summed: torch.Tensor) -> torch.Tensor:
        """Each row's mean squared gradient over the whole row (all processes' columns)."""
        if self.column_group is None:
            return summed.square().mean(1)
        total = summed.square().sum(1)
        dist.all_reduce(total, group=self.column_group)
        return total.div_(summed.shape[1] * self.column_world)

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


def _whole_tables(module: FusedEmbeddingTables, state: dict, prefix: str, metadata) -> None:
    """state_dict(): column-sharded tables gathered whole (a collective)."""
    if module.column_group is None:
        return
    shard = state[prefix + "weight"].detach().contiguous()
    shards = shard.new_empty(module.column_world * shard.shape[0], shard.shape[1])
    _all_gather(shards, shard, group=module.column_group)
    state[prefix + "weight"] = shards.view(module.column_world, *shard.shape).transpose(0, 1).flatten(1)


def _own_columns(module: FusedEmbeddingTables, state: dict, prefix: str, *args) -> None:
    """load_state_dict(): this process's columns of whole tables."""
    weight = state.get(prefix + "weight")
    if module.column_group is not None and weight is not None and weight.shape[1] != module.weight.shape[1]:
        width = module.weight.shape[1]
        rank = dist.get_rank(module.column_group)
        state[prefix + "weight"] = weight[:, rank * width:(rank + 1) * width]


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
