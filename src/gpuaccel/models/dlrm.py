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
- sharded by tables (``shard_tables``; Trainer's way): each process holds whole tables, about
  1 / world of them (TorchRec's table-wise sharding), in ceil(tables / world) slots per process
  (a slot left over looks up a spare row). The forward pass sends each table's ids to the
  process holding it (one all-to-all of batch x slots ids), that process looks up the rows of
  every process's ids for its tables, and a second all-to-all returns them (batch x tables x
  dim values, in the compute dtype); the backward pass sends the gradients back the same way and
  each process updates its own tables' rows, whole, so row-wise Adagrad needs no collective.
  Per process: the rows of one batch's ids to look up and update, whatever the world size, and
  1 / world of the tables' memory. Every size is fixed (the step graph captures it);
  evaluation, whose batches may differ between processes, pads them to the largest.
  ``state_dict()`` gathers the whole tables (a collective: every process calls it), and loading
  whole tables keeps this process's. With ``exchange_chunks`` > 1 the rows and the gradients
  cross in that many chunks of the records, each all-to-all started as soon as its chunk is
  ready and waited for only when its chunk is needed, so that NCCL moves chunk c while the GPU
  looks up chunk c + 1 (forward) or sums chunk c - 1's gradients (backward). By default 4 chunks
  with the tables sharded over 4 or more processes (where it was faster; on 2 no difference
  was resolved), else 1 (docs/results.md, "Several GPUs").
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import GpuaccelError
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
        ctx.module.apply_gradient(ids, grad)
        return None, None, None, None


class _ShardedLookup(torch.autograd.Function):
    """Tables sharded across the processes: this process's ids in, their rows out."""

    @staticmethod
    def forward(ctx, ids, weight, module, dtype):
        rows = module._owner_rows(ids)
        ctx.save_for_backward(rows)
        ctx.module = module
        return module._rows_returned(rows, dtype)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        ctx.module._gradient_returned(rows, grad)
        return None, None, None, None


@eager_forward  # an update inside the backward pass is not for inductor; the step graph captures it
class FusedEmbeddingTables(nn.Module):
    def __init__(self, sizes: list[int], dim: int, lr: float = 0.05, eps: float = 1e-8,
                 exchange_chunks: int | None = None):
        super().__init__()
        if exchange_chunks is not None and exchange_chunks < 1:
            raise GpuaccelError(f"exchange_chunks must be 1 or more, not {exchange_chunks}")
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
        self._plans: dict = {}  # which tables apply_gradient updates whole, by the shape of the ids
        self.process_group = None  # replicated data parallel: the processes whose updates every replica takes
        self.shard_group, self.shard_world = None, 1  # sharded by tables: the processes holding the others
        self.exchange_chunks = exchange_chunks  # sharded: the records' chunks each exchange is sent in (None: chosen)
        self.register_state_dict_post_hook(_whole_tables)
        self.register_load_state_dict_pre_hook(_own_tables)

    def forward(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """(N, T) ids, one per table -> (N, T, dim) rows, in ``dtype`` (default: the tables')."""
        dtype = dtype or self.weight.dtype
        training = self.training and torch.is_grad_enabled()
        if self.shard_group is not None:
            if training:  # (every process's batch has the same size)
                return _ShardedLookup.apply(ids, self.weight, self, dtype)
            return self._evaluation_rows(ids, dtype)
        rows = ids + self.offsets
        if training:
            return _FusedLookup.apply(rows, self.weight, self, dtype)
        return self.weight[rows].to(dtype)

    # ------------------------------------------------------------------ sharding by tables

    def shard_tables(self, group) -> bool:
        """Keeps this process's tables (the same on every process already), largest first to the
        process holding the fewest rows, ceil(tables / world) slots each; False with one process."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if world < 2:
            return False
        tables, slots = len(self.sizes), -(-len(self.sizes) // world)
        owned, held = [[] for _ in range(world)], [0] * world
        for t in sorted(range(tables), key=lambda t: -self.sizes[t]):
            p = min((p for p in range(world) if len(owned[p]) < slots), key=lambda p: held[p])
            owned[p].append(t)
            held[p] += self.sizes[t]
        table_of_slot = [t for p in range(world) for t in owned[p] + [-1] * (slots - len(owned[p]))]
        mine, offsets = owned[rank], self.offsets.tolist()
        keep = torch.cat([torch.arange(offsets[t], offsets[t] + self.sizes[t]) for t in mine] or
                         [torch.zeros(0, dtype=torch.long)])
        spare = keep.numel()  # one more row, zero: what a slot without a table looks up
        device = self.weight.device
        keep = keep.to(device)
        spare_row = self.weight.new_zeros(1, self.weight.shape[1])
        self.weight = nn.Parameter(torch.cat([self.weight.detach()[keep], spare_row]))
        self.weight.updated_in_backward = True
        self.accumulator = torch.cat([self.accumulator[keep], self.accumulator.new_zeros(1)])
        starts = [sum(self.sizes[u] for u in mine[:i]) for i in range(len(mine))]
        local = [starts[i] if i < len(mine) else spare for i in range(slots)]
        self.register_buffer("_local_offsets", torch.tensor(local, device=device).view(slots, 1), persistent=False)
        table_index = torch.tensor([max(t, 0) for t in table_of_slot], device=device)
        self.register_buffer("_slot_table", table_index, persistent=False)  # each slot's table (0 for a blank)
        self.register_buffer("_slot_used", torch.tensor([t >= 0 for t in table_of_slot], device=device).view(
            world, slots, 1), persistent=False)
        position = torch.tensor([table_of_slot.index(t) for t in range(tables)], device=device)
        self.register_buffer("_table_slot", position, persistent=False)  # each table's slot
        self.owned, self.slots, self.tables_here = owned, slots, len(mine)
        self.shard_group, self.shard_world, self._summed, self._plans = group, world, None, {}
        return True

    def _exchange(self, blocks: torch.Tensor) -> torch.Tensor:
        """(world, ...) blocks, block j to process j -> block i from process i."""
        blocks = blocks.contiguous()
        received = torch.empty_like(blocks)
        dist.all_to_all_single(received, blocks, group=self.shard_group)
        return received

    def _chunks(self, records: int) -> int:
        """How many chunks of the records each exchange of rows or gradients goes in: with more than
        one, chunk c crosses while chunk c + 1 is looked up (forward) or chunk c - 1 is summed
        (backward), on NCCL's stream beside the computation. Unless given, 4 where the tables are
        sharded over 4 or more processes, else 1 (what was measured faster)."""
        chunks = self.exchange_chunks or (4 if self.shard_world >= 4 else 1)
        return chunks if records % chunks == 0 else 1

    def _exchange_chunks(self, received: torch.Tensor, sent) -> list:
        """All-to-alls of ``sent``'s chunks ((world, ...) each, contiguous) into ``received``'s
        (chunks, world, ...), started in order; returns their works, to wait for."""
        return [dist.all_to_all_single(received[c], chunk, group=self.shard_group, async_op=True)
                for c, chunk in enumerate(sent)]

    # What crosses an all-to-all is laid out slot-major, (world, slots, N, ...): block j holds what
    # goes to process j, each slot's N values together. Either way one gather lays it out (each
    # table's values stay whole) and the exchange sends it as it is.

    def _by_slot(self, per_table: torch.Tensor, chunks: int = 1) -> torch.Tensor:
        """(N, tables, ...) -> (world, slots, N, ...), contiguous, in one gather (a blank slot holds
        table 0's); with ``chunks`` > 1, (chunks, world, slots, N / chunks, ...): chunk c holds
        records c x N / chunks onwards."""
        n, rest = per_table.shape[0] // chunks, per_table.shape[2:]
        words = _as_words(per_table) if per_table.dim() > 2 else per_table  # (rows, not the ids)
        if chunks == 1:
            by_slot = words.transpose(0, 1)[self._slot_table].view(per_table.dtype)
            return by_slot.view(self.shard_world, self.slots, n, *rest)
        by_slot = words.view(chunks, n, *words.shape[1:]).transpose(1, 2)[:, self._slot_table]
        return by_slot.view(per_table.dtype).view(chunks, self.shard_world, self.slots, n, *rest)

    def _owner_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """This process's rows of every process's ids for its tables: (world, slots, N); a blank
        slot's ids are 0, the spare row."""
        return self._exchange(self._by_slot(ids) * self._slot_used) + self._local_offsets

    def _rows_returned(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(world, slots, N) rows of this process's tables, looked up in ``dtype`` and exchanged
        -> (N, tables, dim) of this process's samples from every process's tables: a transposed
        view of one gather (the interaction's cat reads it as it is), or with several chunks, the
        gather's own (N, tables, dim)."""
        chunks, dim = self._chunks(rows.shape[-1]), self.weight.shape[1]
        if chunks == 1:
            received = self._exchange(self.weight[rows].to(dtype))
            return received.view(-1, rows.shape[-1], dim)[self._table_slot].transpose(0, 1)
        n = rows.shape[-1] // chunks
        received = self.weight.new_empty(chunks, *rows.shape[:2], n, dim, dtype=dtype)
        by_chunk = rows.view(*rows.shape[:2], chunks, n)
        # each chunk's lookup is started before the exchange of the one before it is waited for
        works = self._exchange_chunks(received, (self.weight[by_chunk[:, :, c]].to(dtype) for c in range(chunks)))
        for work in works:
            work.wait()
        # record j of chunk c, table t: received[c, t's slot, j]
        words = _as_words(received.view(chunks, -1, n, dim))
        device = rows.device
        picked = words[torch.arange(chunks, device=device).view(-1, 1, 1), self._table_slot.view(1, 1, -1),
                       torch.arange(n, device=device).view(1, -1, 1)]
        return picked.view(dtype).view(chunks * n, -1, dim)

    def _gradient_returned(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """The backward pass: ``grad``, (N, tables, dim) of this process's samples, goes to the
        tables' processes, and this process updates its tables with every process's."""
        # this process's slots after its own tables are blank (their gradients are table 0's): every id
        # of them is the spare row, and updating it would pile world x batch atomic adds onto one row
        tables, chunks = self.tables_here, self._chunks(rows.shape[-1])
        scale = 1 / self.shard_world  # each process's gradient is of its own mean loss: 1 / world of the whole batch's
        if chunks == 1:
            mine = self._exchange(self._by_slot(grad))  # every process's gradients for this process's rows
            self.apply_gradient(rows[:, :tables], mine[:, :tables], scale=scale)
            return
        sent = self._by_slot(grad, chunks)
        received = torch.empty_like(sent)
        by_chunk = rows.view(*rows.shape[:2], chunks, -1)
        # chunk c is summed while chunk c + 1 crosses
        for c, work in enumerate(self._exchange_chunks(received, sent)):
            work.wait()
            self.accumulate(by_chunk[:, :tables, c], received[c, :, :tables], scale=scale)
        self.update_from_sums(rows[:, :tables])

    def _evaluation_rows(self, ids: torch.Tensor, dtype) -> torch.Tensor:
        """As in training, each process's batch padded to the largest (evaluation's batches may
        differ in size between processes; this costs a host synchronisation)."""
        count = torch.tensor([ids.shape[0]], device=ids.device)
        counts = count.new_empty(self.shard_world)
        _all_gather(counts, count, group=self.shard_group)
        padded = torch.cat([ids, ids.new_zeros(int(counts.max()) - ids.shape[0], *ids.shape[1:])])
        return self._rows_returned(self._owner_rows(padded), dtype)[:ids.shape[0]]

    # ------------------------------------------------------------------ the update

    @torch.no_grad()
    def apply_gradient(self, rows: torch.Tensor, grad: torch.Tensor, scale: float = 1.0) -> None:
        """Row-wise Adagrad with ``scale`` x ``grad`` (scaled as it is summed: no pass of its own
        over the gradients). ``rows``: this process's tables along dimension 1 (a batch's ids,
        (N, tables), or every process's ids for this process's tables, (world, tables, N)), rows
        repeated any number of times; ``grad``: ``rows``' shape and the rows' width.

        Duplicated rows sum their gradients first. A table with no more rows than the step has ids
        for it is then updated whole, each row once (Adagrad leaves a row without gradient as it
        was); the others row by row, every occurrence of a row writing the same values. Why: ids
        drawn with a heavy head put thousands of writes a step on a small table's few rows, and
        with tables sharded each process applies every process's ids, so the writes to one row
        multiply with the processes (docs/parallel.md)."""
        if self.process_group is not None:
            rows, grad = self._gathered(rows, grad)
            # each process's gradient is of its own mean loss: over the whole batch, 1 / world of it
            scale /= dist.get_world_size(self.process_group)
        self.accumulate(rows, grad, scale)
        self.update_from_sums(rows)

    @torch.no_grad()
    def accumulate(self, rows: torch.Tensor, grad: torch.Tensor, scale: float = 1.0) -> None:
        """Adds ``scale`` x ``grad`` to the rows' gradient sums (:meth:`apply_gradient`'s first half)."""
        if self._summed is None or self._summed.device != grad.device:
            self._summed = torch.zeros(self.weight.shape, dtype=torch.float32, device=grad.device)
        # converted before it is flattened: a strided gradient (one process's: a slice of the
        # interaction's) becomes contiguous fp32 in the conversion's one pass, not a copy and then it
        grad = grad.float().reshape(-1, grad.shape[-1])
        self._summed.index_add_(0, rows.reshape(-1), grad, alpha=scale)

    @torch.no_grad()
    def update_from_sums(self, rows: torch.Tensor) -> None:
        """Row-wise Adagrad on ``rows`` (:meth:`apply_gradient`'s) from their gradient sums, which it
        clears (:meth:`apply_gradient`'s second half)."""
        whole_rows, by_row = self._update_plan(rows)
        if whole_rows is not None:
            self._adagrad(whole_rows)
        if by_row is not None:
            self._adagrad(rows.index_select(1, by_row).reshape(-1))

    def _update_plan(self, rows: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(every row of the tables updated whole, the positions along ``rows``' dimension 1 of the
        tables updated row by row); either None when empty. One per shape of ``rows``, made at its
        first (eager) step and kept: a captured step holds on to the one it was recorded with."""
        key = (tuple(rows.shape), rows.device)
        if key not in self._plans:
            ids_per_table = rows.numel() // max(rows.shape[1], 1)  # (a process may hold no table)
            whole, by_row = [], []
            for position, (start, count) in enumerate(self._local_tables()):
                (whole if count <= ids_per_table else by_row).append((position, start, count))
            whole_rows = torch.cat([torch.arange(start, start + count) for _, start, count in whole]) if whole else None
            by_row = torch.tensor([position for position, _, _ in by_row]) if by_row else None
            self._plans[key] = tuple(t if t is None else t.to(rows.device) for t in (whole_rows, by_row))
        return self._plans[key]

    def _local_tables(self) -> list[tuple[int, int]]:
        """(first row in ``weight``, rows) of each table this process updates, in the order of the
        tables' ids (dimension 1 of :meth:`apply_gradient`'s ``rows``)."""
        if self.shard_group is None:
            return list(zip(self.offsets.tolist(), self.sizes))
        tables = self.owned[dist.get_rank(self.shard_group)]
        starts = [sum(self.sizes[u] for u in tables[:i]) for i in range(len(tables))]
        return [(start, self.sizes[t]) for start, t in zip(starts, tables)]

    def _adagrad(self, rows: torch.Tensor) -> None:
        """Row-wise Adagrad on ``rows`` (duplicates allowed) from their summed gradients, which it
        clears."""
        summed = self._summed[rows]  # every occurrence of a row reads the same sum ...
        accumulated = self.accumulator[rows] + summed.square().mean(1)
        # ... so every write of a duplicated row writes the same value: the update happens once
        self.accumulator.index_put_((rows,), accumulated)
        step = summed * (self.lr / (accumulated.sqrt() + self.eps)).unsqueeze(1)
        _as_words(self.weight).index_put_((rows,), _as_words(self.weight[rows] - step.to(self.weight.dtype)))
        _as_words(self._summed).index_fill_(0, rows, 0)  # (0.0's bits)

    def _gathered(self, rows: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every process's rows and gradients, one process's after another along dimension 0
        (fixed sizes: each process has the same batch)."""
        world = dist.get_world_size(self.process_group)
        all_rows = rows.new_empty(world * rows.shape[0], *rows.shape[1:])
        _all_gather(all_rows, rows.contiguous(), group=self.process_group)
        grad = grad.contiguous()
        all_grad = grad.new_empty(world * grad.shape[0], *grad.shape[1:])
        _all_gather(all_grad, grad, group=self.process_group)
        return all_rows, all_grad


def _as_words(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (..., width) with each row's values read as 8-byte words, a view, where its layout
    allows; else ``rows``. Why: PyTorch's element-wise index kernels (indexing a strided view,
    index_put_, index_fill_) move one element per thread, so a row of 128 fp32 values moves as 64
    elements, of 128 bf16 values as 32. The bits are moved as they are."""
    ratio = 8 // rows.element_size()
    if ratio <= 1 or rows.dim() < 2 or rows.stride(-1) != 1 or rows.shape[-1] % ratio or \
            rows.storage_offset() % ratio or any(stride % ratio for stride in rows.stride()[:-1]):
        return rows
    return rows.view(torch.int64)


def _whole_tables(module: FusedEmbeddingTables, state: dict, prefix: str, metadata) -> None:
    """state_dict(): tables sharded across the processes gathered whole (a collective)."""
    if module.shard_group is None:
        return
    longest = max(sum(module.sizes[t] for t in tables) for tables in module.owned) + 1  # (+ the spare row)
    for name in ("weight", "accumulator"):
        mine = state[prefix + name].detach()
        padded = torch.cat([mine, mine.new_zeros(longest - mine.shape[0], *mine.shape[1:])]).contiguous()
        everyone = padded.new_empty(module.shard_world * longest, *mine.shape[1:])
        _all_gather(everyone, padded, group=module.shard_group)
        everyone = everyone.view(module.shard_world, longest, *mine.shape[1:])
        whole = mine.new_empty(sum(module.sizes), *mine.shape[1:])
        offsets = module.offsets.tolist()
        for p, tables in enumerate(module.owned):
            start = 0
            for t in tables:
                whole[offsets[t]:offsets[t] + module.sizes[t]] = everyone[p, start:start + module.sizes[t]]
                start += module.sizes[t]
        state[prefix + name] = whole


def _own_tables(module: FusedEmbeddingTables, state: dict, prefix: str, *args) -> None:
    """load_state_dict(): this process's tables of whole ones (and the spare row)."""
    if module.shard_group is None:
        return
    offsets, rank = module.offsets.tolist(), dist.get_rank(module.shard_group)
    for name in ("weight", "accumulator"):
        whole = state.get(prefix + name)
        if whole is None or whole.shape[0] != sum(module.sizes):
            continue
        parts = [whole[offsets[t]:offsets[t] + module.sizes[t]] for t in module.owned[rank]]
        state[prefix + name] = torch.cat([*parts, whole.new_zeros(1, *whole.shape[1:])])


def _mlp(sizes: list[int], last_activation: bool) -> nn.Sequential:
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_activation:
            layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, dense_features: int, table_sizes: list[int], dim: int, bottom: list[int], top: list[int],
                 table_lr: float, exchange_chunks: int | None = None):
        super().__init__()
        self.tables = FusedEmbeddingTables(table_sizes, dim, table_lr, exchange_chunks=exchange_chunks)
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
         table_lr: float = 0.05, exchange_chunks: int | None = None) -> DLRM:
    """DLRM: bottom MLP for dense features, fused embedding tables for sparse ones, pairwise dot
    interactions, top MLP to one click logit (MLPerf's Criteo sizes by default, tables aside).
    ``exchange_chunks``: with the tables sharded across processes, the chunks of records each
    exchange of rows and gradients is sent in, so that it overlaps the lookups and the sums
    (default: 4 with 4 or more processes, else 1)."""
    return DLRM(dense_features, list(table_sizes), dim, list(bottom), list(top), table_lr, exchange_chunks)
