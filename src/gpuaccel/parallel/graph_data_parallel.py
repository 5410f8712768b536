"""Data parallel for a training step captured as one CUDA graph (runtime/capture.py): rank
0's weights are broadcast once, and the step itself averages the gradients, recorded inside the
graph. DDP cannot serve here: its reducer's hooks and bucket bookkeeping run on the host during
the backward pass, which a replayed graph skips.

Gradients that fill more than one bucket (``bucket_cap_mb``, ``--ddp-bucket-mb``) are averaged
bucket by bucket while the backward pass runs (gradient_buckets.py), and the model is compiled
with its graph split at the buckets' boundaries so that its backward pass hands them back one
bucket at a time. Gradients that fit one bucket are averaged in one all-reduce after the
backward pass: there would be nothing to overlap it with, and a split graph gives the compiler
fewer chances to fuse. ``bucket_cap_mb=None``: always one all-reduce after the backward pass.

Both doors average a captured step's gradients here: ``Trainer`` chooses this strategy when its
step is captured; ``Accelerator.capture`` (and ``captured``) comes after ``prepare`` wrapped the
model in DDP, and takes it over with :meth:`GraphDataParallel.from_ddp`.
"""

from __future__ import annotations

import contextlib

from .base import Strategy
from .data_parallel import (DataParallel, TablesShardedMixin, average_gradients, broadcast_state,
                            share_backward_updates)
from .gradient_buckets import GradientBuckets, trainable_parameters


class GraphDataParallel(TablesShardedMixin, Strategy):
    name = "data parallel (all-reduce inside the step graph)"

    def __init__(self, device, rank: int = 0, world_size: int = 1, *, shard_tables: bool = False,
                 bucket_cap_mb: float | None = None):
        super().__init__(device, rank, world_size)
        self.shard_tables = shard_tables
        self.bucket_bytes = None if bucket_cap_mb is None else int(bucket_cap_mb * 2**20)
        self.buckets: GradientBuckets | None = None  # None: one all-reduce after the backward pass
        self.ddp = None  # the DDP wrapper a script holds (from_ddp): its require_backward_grad_sync is obeyed

    @classmethod
    def from_ddp(cls, strategy: DataParallel) -> GraphDataParallel:
        """``strategy``'s model averaged inside the step graph from now on: DDP's reducer runs hooks
        on the host during the backward pass, which a replay skips, and keeps each parameter's
        gradient accumulator from the stream it was made on, which a capture may not wait for. So
        the reducer is dropped (the wrapper then calls the model directly) and the gradients are
        averaged in one all-reduce after the backward pass. The replicas are equal already: DDP
        broadcast rank 0's when it wrapped the model."""
        strategy.drop_reducer()
        graph = cls(strategy.device, strategy.rank, strategy.world_size, shard_tables=strategy.shard_tables)
        graph.model, graph.ddp = strategy.model, strategy.ddp
        graph._note_sharded_tables()
        return graph

    def averages_now(self) -> bool:
        """Whether this backward pass's gradients are to be averaged: not when a script keeps them
        local as it would with DDP (``model.require_backward_grad_sync = False``, nanoGPT's way,
        or inside ``ddp.no_sync()``)."""
        return self.ddp is None or self.ddp.require_backward_grad_sync

    def wrap(self, model, *, first_inputs=None, loss_fn=None):
        broadcast_state(model)
        share_backward_updates(model, shard_tables=self.shard_tables)
        self.model = model
        self._note_sharded_tables()
        params = trainable_parameters(model)
        if self.bucket_bytes is not None and sum(p.numel() * p.element_size() for p in params) > self.bucket_bytes:
            self.buckets = GradientBuckets(params, self.bucket_bytes, self.device)
        return model

    def training_forward(self, compile):
        if self.buckets is None:
            return compile(self.training_module)
        return compile(self.training_module, split_bytes=self.bucket_bytes)

    def eval_forward(self, compile, training_forward, average):
        if self.buckets is None or average is not None:
            return super().eval_forward(compile, training_forward, average)
        return compile(self.model)  # (no gradients to hand back: compiled whole, fused as on one GPU)

    def gradient_sync(self, sync: bool):
        if sync and self.buckets is not None:
            self.buckets.start()
        return contextlib.nullcontext()

    def reduce_gradients(self, params) -> None:
        """After the step's backward passes: the gradients averaged (the buckets' collectives
        waited for)."""
        if self.buckets is None:
            average_gradients(params)
        else:
            self.buckets.finish()

    def describe(self) -> str:
        how = "the gradient all-reduce inside the step graph" if self.buckets is None else \
            f"the gradient all-reduce inside the step graph, in {len(self.buckets.buckets)} buckets during the " \
            "backward pass"
        return f"{self.world_size} processes, {how}" + self._tables_note()
