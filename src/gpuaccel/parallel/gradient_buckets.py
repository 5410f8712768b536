"""The gradient all-reduce of data parallel in buckets launched while the backward pass runs,
for a training step captured as one CUDA graph (graph_data_parallel.py), where DDP's reducer
cannot serve: its hooks and bookkeeping run on the host at every step, which a replayed graph
skips.

How: the trainable parameters are split into buckets, each of about ``cap_bytes`` of
gradients, first in the reverse of their registration order (where a backward pass usually
finishes their gradients), then, as DDP does after its first iteration, in the order the first
averaging backward pass finished them (rank 0's order, so that every process has the same
buckets; this takes a collective and a host synchronisation, so it happens in that first pass,
which must run eagerly, as the warm-up before a recording does). A hook on each parameter notes its
gradient once the backward pass has accumulated it; when every gradient of the next bucket is
there, the bucket is averaged on a stream of its own (``average_gradients``: one flat buffer,
one all-reduce), so the collective runs beside the rest of the backward pass. Buckets are always
launched in their order, so every process issues the same collectives in the same order.
:meth:`GradientBuckets.finish` launches what is left (parameters without a gradient in this
step) and makes the step's stream wait for the collectives. Recorded inside a CUDA graph, the
forked stream and the waits become the graph's edges, and a replay overlaps the same way.

The hooks fire while gradients come back, and a model compiled whole hands every gradient back
at the end of its one compiled backward pass: there is nothing to overlap then. The model is
therefore compiled with its graph cut into pieces of about a bucket's size
(``compiling.compile_module``'s ``split_bytes``: Dynamo's DDPOptimizer, what torch.compile does
under DDP), one compiled backward function per piece: slightly shorter steps for seconds more
warm-up (docs/results.md, "Several GPUs"), hence opt-in (``--overlap-gradients``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .base import consecutive_groups
from .data_parallel import average_gradients


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters whose gradients data parallel averages: those that require a gradient,
    less those their module updates inside the backward pass (``updated_in_backward``)."""
    return [p for p in model.parameters() if p.requires_grad and not getattr(p, "updated_in_backward", False)]


def split_into_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """``params`` cut into consecutive buckets, each closed once it holds at least ``cap_bytes``
    of gradients (so every bucket but the last reaches it)."""
    return consecutive_groups(params, cap_bytes, lambda p: p.numel() * p.element_size())


class GradientBuckets:
    """Averages the gradients of ``params`` across the processes, bucket by bucket, as the
    backward pass completes them. Call :meth:`start` before a backward pass whose gradients are
    to be averaged (the last of an accumulation) and :meth:`finish` after it, before anything
    reads the gradients. A backward pass without :meth:`start` (a micro-batch of an
    accumulation) launches nothing; :meth:`finish` without :meth:`start` averages every bucket."""

    def __init__(self, params: list[nn.Parameter], cap_bytes: int, device: torch.device):
        self.params, self.cap_bytes, self.device = list(params), cap_bytes, device
        self._arrange(self.params[::-1])
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._waiting: list[int] = []  # per bucket: gradients not yet accumulated in this backward pass
        self._launched = 0  # buckets launched, in order, since start()
        self._active = False
        self._finished: list[nn.Parameter] | None = []  # the order of the first averaging pass (None: used)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def _arrange(self, order: list[nn.Parameter]) -> None:
        """Buckets of consecutive parameters of ``order``, the first finished first."""
        self.buckets = split_into_buckets(order, self.cap_bytes)
        self._bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}

    def start(self) -> None:
        self._waiting = [len(bucket) for bucket in self.buckets]
        self._launched = 0
        self._active = True

    def _gradient_ready(self, param: nn.Parameter) -> None:
        """Called by autograd (on its device thread, on the stream of the backward pass) once
        ``param``'s gradient of this backward pass has been accumulated."""
        if not self._active:
            return
        if self._finished is not None:
            self._finished.append(param)
        self._waiting[self._bucket_of[param]] -= 1
        while self._launched < len(self.buckets) and self._waiting[self._launched] == 0:
            self._launch(self._launched)
            self._launched += 1

    def finish(self) -> None:
        launched = self._launched if self._active else 0
        for index in range(launched, len(self.buckets)):
            self._launch(index)
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        if self._active and self._finished is not None:
            self._rearrange()
        self._active, self._launched = False, 0

    def _rearrange(self) -> None:
        """The buckets in the order rank 0's first averaging backward pass finished the gradients
        (those it did not finish after, in reverse registration order)."""
        index = {p: i for i, p in enumerate(self.params)}
        seen = set(self._finished)
        order = self._finished + [p for p in reversed(self.params) if p not in seen]
        self._finished = None
        agreed = torch.tensor([index[p] for p in order], device=self.device)
        dist.broadcast(agreed, 0)
        self._arrange([self.params[i] for i in agreed.tolist()])

    def _launch(self, index: int) -> None:
        params = [p for p in self.buckets[index] if p.grad is not None]
        if not params:
            return
        if self._stream is None:
            average_gradients(params)
            return
        computing = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(computing)
        computed = [p.grad for p in params]
        with torch.cuda.stream(self._stream):
            average_gradients(params)
        # the caching allocator must know which streams use which memory: the gradients the
        # backward pass made are read on the bucket's stream; the averaged ones it made are
        # read on the step's
        for grad in computed:
            grad.record_stream(self._stream)
        params[0].grad.record_stream(computing)
