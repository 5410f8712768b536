"""Data parallel for a training step captured as one CUDA graph (runtime/capture.py): rank
0's weights are broadcast once, and the step itself averages the gradients in one
all-reduce of a flat buffer, recorded inside the graph. DDP cannot serve here: its
reducer's hooks and bucket bookkeeping run on the host during the backward pass, which a
replayed graph skips."""

from __future__ import annotations

from .base import Strategy
from .data_parallel import TablesShardedMixin, average_gradients, broadcast_state, share_backward_updates


class GraphDataParallel(TablesShardedMixin, Strategy):
    name = "data parallel (all-reduce inside the step graph)"
    reduce_gradients = staticmethod(average_gradients)

    def __init__(self, device, rank: int = 0, world_size: int = 1, *, shard_tables: bool = False):
        super().__init__(device, rank, world_size)
        self.shard_tables = shard_tables

    def wrap(self, model, *, first_inputs=None, loss_fn=None):
        broadcast_state(model)
        share_backward_updates(model, shard_tables=self.shard_tables)
        self.model = model
        self._note_sharded_tables()
        return model

    def describe(self) -> str:
        return f"{self.world_size} processes, the gradient all-reduce inside the step graph" + self._tables_note()
