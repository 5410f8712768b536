"""The whole training step as one CUDA graph: forward, loss, backward, the gradient
all-reduce of data parallel, gradient clipping, the optimizer's update and the weight
average, replayed with a single launch.

Why: torch.compile's CUDA graphs (mode reduce-overhead) cover the forward and the backward
pass as separate graphs, each replayed through Python bookkeeping, with the loss, the
optimizer and the weight average launched kernel by kernel around them. For a small
network that bookkeeping, not the GPU, sets the pace: measured on an H200 host, 3.6 ms of
host time per FastNet step against about 2 ms of GPU work. Here the model is compiled
without graphs (inductor's fused kernels) and the step is captured once, as in PyTorch's
"whole network capture" recipe; a replay costs the host a few copies and one launch.

What changes per step enters through tensors the graph reads: the batch (its inputs and
targets, any tuple or dict of tensors, copied into static ones), each parameter group's learning rate and the weight average's blend
weight (filled on the host before the replay). The optimizer keeps float learning rates
for the scheduler, logs and checkpoints; only while the graph is captured do its groups
hold the tensors. Momentum buffers are created before the capture (zeros: the same update
as a first step), so the captured update is the steady-state one.

State must stay where the graph was captured: parameters, buffers, gradients and optimizer
state are updated in place, and loading state into them must copy in place too; capture
again after replacing any of them (``Trainer.warm_up`` captures last, after restoring).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..tasks import call_model
from .ema import WeightAverage


def _copy_into(static, new) -> None:
    tree_map(lambda s, n: s.copy_(n), static, new)


class StepGraph:
    def __init__(self, model: nn.Module, forward: Callable, optimizer: torch.optim.Optimizer, *,
                 loss_fn: Callable, autocast: Callable[[], contextlib.AbstractContextManager],
                 grad_clip: float | None = None, ema: WeightAverage | None = None,
                 reduce_gradients: Callable[[list[torch.Tensor]], None] | None = None):
        """``forward``: the (compiled) model's call; ``loss_fn(outputs, targets)``: the task's
        loss; ``autocast()``: a fresh autocast context with its weight cache off (a cache would
        hold tensors from before the capture); ``reduce_gradients(grads)``: averages them in
        place over data-parallel processes."""
        self.model, self.forward, self.optimizer, self.loss_fn = model, forward, optimizer, loss_fn
        self.autocast, self.grad_clip, self.ema = autocast, grad_clip, ema
        self.reduce_gradients = reduce_gradients
        device = next(model.parameters()).device
        self.lrs = [torch.zeros((), device=device) for _ in optimizer.param_groups]
        self.ema_weight = torch.zeros((), device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs = self.targets = self.loss = None

    def _body(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)  # gradients are then allocated by the graph, once
        with self.autocast():
            loss = self.loss_fn(call_model(self.forward, self.inputs), self.targets)
        loss.backward()
        if self.reduce_gradients is not None:
            self.reduce_gradients([p.grad for p in self.model.parameters() if p.grad is not None])
        if self.grad_clip is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        if self.ema is not None:
            self.ema.blend(self.model, self.ema_weight)
        return loss.detach()

    def _load_lrs(self) -> None:
        """The groups' current (float) learning rates into the tensors the step reads."""
        for group, lr in zip(self.optimizer.param_groups, self.lrs):
            lr.fill_(group["lr"])

    @contextlib.contextmanager
    def _tensor_lrs(self):
        self._load_lrs()
        groups = self.optimizer.param_groups
        rates = [group["lr"] for group in groups]
        for group, lr in zip(groups, self.lrs):
            group["lr"] = lr
        try:
            yield
        finally:
            for group, rate in zip(groups, rates):
                group["lr"] = rate

    def warm(self, inputs, targets, steps: int = 3) -> None:
        """Runs the step's code eagerly on a side stream (compilation, cuDNN's algorithm search,
        per-stream library workspaces), as ``torch.cuda.make_graphed_callables`` does. It trains:
        save and restore the state around it, then call :meth:`capture`."""
        self.inputs, self.targets = tree_map(torch.clone, inputs), tree_map(torch.clone, targets)
        if self.ema is not None:
            self.ema_weight.fill_(1.0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), self._tensor_lrs():
            for _ in range(steps):
                self._body()
        torch.cuda.current_stream().wait_stream(side)

    def prepare(self) -> None:
        """Creates the optimizer state a captured step reads, as the first eager step would: SGD
        momentum buffers as zeros (the first update is then the same as PyTorch's first step,
        which copies the gradient); Adam's moments as zeros and its step count as a device
        tensor (capturable). Created inside the capture, they would be zeroed by every replay."""
        adam = isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW))
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state[p]
                if adam and not state:
                    state.update(step=torch.zeros((), dtype=torch.float32, device=p.device),
                                 exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                                 exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
                elif group.get("momentum") and not adam and state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def capture(self) -> None:
        """Records the step (after :meth:`warm`). The state it records must not be replaced afterwards."""
        self.prepare()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with self._tensor_lrs(), torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.loss = self._body()

    def release(self) -> None:
        """Frees the recorded graph (the next :meth:`capture` records it again). A graph holding a
        captured NCCL all-reduce must go before its process group is destroyed: with one alive,
        every process of a 4-GPU run hung at exit (torch 2.11, NCCL)."""
        if self.graph is not None:
            torch.cuda.synchronize()
            self.graph.reset()
            self.graph = None

    def run(self, inputs, targets) -> torch.Tensor:
        """One training step on this batch; returns the loss (overwritten by the next step).
        Before :meth:`capture` the same code runs eagerly (on any device)."""
        if self.ema is not None:
            self.ema_weight.fill_(self.ema.advance())
        if self.graph is None:
            self.inputs, self.targets = inputs, targets
            with self._tensor_lrs():
                return self._body()
        self._load_lrs()
        _copy_into(self.inputs, inputs)
        _copy_into(self.targets, targets)
        self.graph.replay()
        return self.loss
