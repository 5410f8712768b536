"""What a parallel strategy is: how this process takes part in training.

A strategy is applied to a plain model once (:meth:`Strategy.wrap`) and then answers the
few questions the training loop would otherwise branch on: which module a training step
runs and which one evaluation runs, how a forward and backward pass is done (and when
gradients are combined across processes), how gradients are clipped, how a checkpoint's
full state is gathered and loaded, and which processes read different data.

One file per strategy (torchtitan's habit: parallelism applied to a plain model by one
component per technique):

- :class:`SingleDevice` (here): one process, one device.
- ``data_parallel.DataParallel``: DistributedDataParallel.
- ``graph_data_parallel.GraphDataParallel``: data parallel whose gradient all-reduce is
  inside the whole-step CUDA graph (no DDP hooks).
- ``fsdp.Sharded``: FSDP2, optionally with CPU offload.
- ``pipeline.PipelineParallel``: pipeline stages (torch.distributed.pipelining).

``gpuaccel.runtime.strategy`` picks one from the settings (Trainer's) or the argument (Accelerator's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..device import new_host_copy
from ..errors import GpuaccelError


def consecutive_groups(items: list, cap: float, size) -> list[list]:
    """``items`` cut into consecutive groups, each closed once the sizes of its items (``size(item)``)
    add up to at least ``cap`` (so every group but the last reaches it; 0: a group per item)."""
    groups, current, total = [], [], 0
    for item in items:
        current.append(item)
        total += size(item)
        if total >= cap:
            groups.append(current)
            current, total = [], 0
    return groups + [current] if current else groups


class Strategy:
    name = "one device"
    collective_state = False  # every process takes part in gathering a checkpoint
    shards_state = False  # a checkpoint keeps each process's shards (DCP) instead of gathering them
    counts_metrics = True  # this process computes the loss and metrics
    needs_warm_up = False  # its first steps must run before the clock starts, even on a CPU
    places_parameters = False  # it moves the parameters to where they belong itself (from the host)
    local_forward = True  # this process alone can run the whole model's forward pass
    reduce_gradients: Callable[[Iterable[nn.Parameter]], None] | None = None  # inside a step graph

    def __init__(self, device: torch.device, rank: int = 0, world_size: int = 1):
        self.device, self.rank, self.world_size = device, rank, world_size
        self.model: nn.Module | None = None

    @property
    def data_rank(self) -> int:
        """Which shard of the data this process reads."""
        return self.rank

    @property
    def data_ranks(self) -> int:
        """How many processes read different data."""
        return self.world_size

    def wrap(self, model: nn.Module, *, first_inputs: Callable | None = None, loss_fn: Callable | None = None) -> nn.Module:
        """Applies the strategy to ``model``; returns the module whose parameters are trained
        (what the optimizer, the weight average and checkpoints see). ``first_inputs()`` gives a
        training batch's inputs, for strategies that need an example."""
        self.model = model
        return model

    @property
    def training_module(self) -> nn.Module:
        """What a training step calls (a wrapper that hooks the backward pass, or the model)."""
        return self.model

    def training_forward(self, compile: Callable[[nn.Module], Callable]) -> Callable | None:
        return compile(self.training_module)

    def eval_forward(self, compile: Callable[[nn.Module], Callable], training_forward: Callable | None,
                     average: nn.Module | None) -> Callable:
        """What evaluation calls: the weight average when there is one, the bare model rather
        than a training wrapper, else the training forward (compiled once, not twice)."""
        if average is not None or self.training_module is not self.model:
            return compile(average if average is not None else self.model)
        return training_forward

    def gradient_sync(self, sync: bool):
        """A context for one forward and backward pass; ``sync=False`` keeps the gradients
        local (a micro-batch of an accumulation)."""
        return contextlib.nullcontext()

    def forward_backward(self, step: Callable, inputs, targets, sync: bool) -> torch.Tensor:
        """Runs ``step(inputs, targets)`` (forward, loss, backward; returns the loss)."""
        with self.gradient_sync(sync):
            return step(inputs, targets)

    def clip_gradients(self, max_norm: float) -> None:
        nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def gather_state(self, optimizer: torch.optim.Optimizer | None, to_host=None):
        """(model state, optimizer state or None) for a checkpoint, on the CPU of rank 0; each
        model tensor copied by ``to_host`` where given (e.g. into reused page-locked buffers:
        ``device.PinnedCopies``), else to new host memory."""
        model_state = {k: (to_host or new_host_copy)(v) for k, v in self.model.state_dict().items()}
        return model_state, None if optimizer is None else optimizer.state_dict()

    def load_state(self, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state) -> None:
        self.model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)

    def blank_evaluation_passes(self, batches: int) -> int:
        """How many forward passes on a blank sample this process runs after its ``batches``
        evaluation batches: where the forward pass is a collective, every process must run as
        many as the one with the most. Asked before the first batch."""
        return 0

    def fuses(self, optimizer: str) -> bool:
        """Whether PyTorch's fused kernel of ``optimizer`` (adam, adamw, sgd) can update the parameters."""
        return True

    def describe(self) -> str:
        return ""


class SingleDevice(Strategy):
    """One process on one device: nothing to combine or gather."""


def shortfall_of_batches(device: torch.device, batches: int) -> int:
    """How many fewer evaluation batches this process has than the process with the most (a
    collective)."""
    most = torch.tensor([float(batches)], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item()) - batches


def refuse_backward_updates(model: nn.Module, strategy: str) -> None:
    """Sharded and pipelined models cannot hold parameters updated inside the backward pass."""
    for name, p in model.named_parameters():
        if getattr(p, "updated_in_backward", False):
            raise GpuaccelError(f"{strategy} cannot train {name}, which its module updates inside the backward pass "
                                "(train it with data parallel: leave out --shard and --pipeline-stages)")
