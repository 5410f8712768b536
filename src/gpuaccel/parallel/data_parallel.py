"""DistributedDataParallel applied to a plain model, and the two collectives that data parallel
needs when the training step is one CUDA graph instead.

Gradients are averaged across processes in buckets while the backward pass runs.
Settings, and why:
- ``bucket_cap_mb`` (``--ddp-bucket-mb``, default 25): smaller buckets start the first
  all-reduce earlier and overlap more of the backward pass; larger ones launch fewer
  collectives. 25 MB is PyTorch's default and suits ResNet-sized models on NVLink;
  models under ~10 M parameters gain from fewer, larger buckets (e.g. 100).
- ``gradient_as_bucket_view``: gradients live inside the communication buckets, which
  saves one copy and the memory of a second set of gradients.
- ``broadcast_buffers=False``: batch-norm running statistics stay per process (they are
  only used for evaluation, and rank 0's are the ones saved), which saves a broadcast
  before every forward pass. ``--sync-bn`` converts batch norm to SyncBatchNorm, which
  normalises with statistics over the global batch (GPUs only).
- Parameters a model updates itself inside its backward pass (``updated_in_backward``, e.g.
  models/dlrm.py's embedding tables) have no gradient for DDP to average: DDP leaves them
  alone, and their module gathers every process's updates itself (``process_group``).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import GpuaccelError
from .base import Strategy, shortfall_of_batches


def apply_ddp(model: nn.Module, device: torch.device, *, bucket_cap_mb: float = 25.0,
              sync_batchnorm: bool = False, shard_tables: bool = False) -> tuple[nn.Module, DistributedDataParallel]:
    """Returns (the model, possibly with SyncBatchNorm layers, its DDP wrapper). Train
    through the wrapper; save and evaluate the model itself."""
    if sync_batchnorm:
        if device.type != "cuda":
            raise GpuaccelError("--sync-bn needs GPUs: SyncBatchNorm does not run on the CPU")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, share_backward_updates(model, shard_tables=shard_tables))
    with warnings.catch_warnings():
        # torch 2.13 deprecates broadcast_buffers for forward_sync_buffers, whose False still syncs the
        # buffers once at the start; the per-process statistics described above need the old flag
        warnings.filterwarnings("ignore", message=r".*broadcast_buffers.*", category=FutureWarning)
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                      bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True,
                                      broadcast_buffers=False)
    return model, ddp


def share_backward_updates(model: nn.Module, *, shard_tables: bool = False) -> list[str]:
    """Each module that updates a parameter inside its backward pass (``updated_in_backward``)
    gets rank 0's parameters and buffers, and then either keeps its share of them
    (``shard_tables``, where the module can: its ``shard_tables``) or the process group, so
    that it takes every process's update. Returns the names of those parameters and buffers
    (what DDP must ignore)."""
    names = []
    for prefix, module in model.named_modules():
        own = [name for name, p in module.named_parameters(recurse=False) if getattr(p, "updated_in_backward", False)]
        if not own:
            continue
        if not hasattr(module, "process_group"):
            raise GpuaccelError(f"{type(module).__name__} updates its parameters inside the backward pass and has no "
                                "process_group to share those updates over, so it cannot train on several processes")
        broadcast_state(module)
        if not (shard_tables and hasattr(module, "shard_tables") and module.shard_tables(dist.group.WORLD)):
            module.process_group = dist.group.WORLD
        names += [f"{prefix}.{name}" if prefix else name for name, _ in
                  [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]]
    return names


def holds_sharded_tables(model: nn.Module) -> bool:
    """Whether a module of ``model`` keeps only its share of its tables: its forward pass and
    its state_dict() are then collectives."""
    return any(getattr(module, "shard_group", None) is not None for module in model.modules())


def broadcast_state(module: nn.Module, src: int = 0) -> None:
    """Gives every process rank ``src``'s parameters and buffers (what DDP does when it wraps a
    model), for data parallel without the DDP wrapper."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src)


def average_gradients(params) -> None:
    """Averages the gradients of ``params`` over the processes in one all-reduce of a flat
    buffer: data parallel inside a captured CUDA graph (runtime/capture.py), where DDP's hooks
    cannot run. NCCL collectives can be captured once the communicator exists (the step's
    warm-up creates it). Each gradient is copied into the buffer in its own memory order (a
    channels-last one as it lies) and afterwards is its view of the buffer, laid out as before:
    one copy kernel in all, where copying each averaged gradient back took one per parameter."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    flat = torch.cat([_elements_in_memory_order(g) for g in grads])
    if dist.get_backend() == dist.Backend.NCCL:
        dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    else:  # (gloo has no average)
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
    for p, grad, part in zip(params, grads, flat.split([g.numel() for g in grads])):
        p.grad = part.as_strided(grad.shape, grad.stride()) if _dense(grad) else part.view(grad.shape)


def _elements_in_memory_order(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense tensor's elements in the order they lie in memory (a copy in
    index order for any other)."""
    return tensor.as_strided((tensor.numel(),), (1,)) if _dense(tensor) else tensor.reshape(-1)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether the tensor's elements fill a block of memory without gaps or overlaps, in some
    order of its dimensions (contiguous, channels-last, a transpose)."""
    expected = 1
    for size, stride in sorted(((n, s) for n, s in zip(tensor.shape, tensor.stride()) if n != 1), key=lambda x: x[1]):
        if stride != expected:
            return False
        expected *= size
    return True


class TablesShardedMixin:
    """What a data-parallel strategy changes where its model holds tables sharded across the processes:
    checkpoints gathered from every process, forward passes run on all of them together."""

    tables_sharded = False

    def _note_sharded_tables(self) -> None:  # (after wrap)
        self.tables_sharded = holds_sharded_tables(self.model)
        if self.tables_sharded:
            self.collective_state, self.local_forward = True, False

    def blank_evaluation_passes(self, batches):
        return shortfall_of_batches(self.device, batches) if self.tables_sharded else 0

    def _tables_note(self) -> str:
        return ", tables sharded across the processes" if self.tables_sharded else ""


class DataParallel(TablesShardedMixin, Strategy):
    """Each process trains a replica on its shard of every batch; DistributedDataParallel
    averages the gradients in buckets while the backward pass runs."""

    name = "data parallel (DDP)"

    def __init__(self, device: torch.device, rank: int, world_size: int, *, bucket_cap_mb: float = 25.0,
                 sync_batchnorm: bool = False, shard_tables: bool = False):
        super().__init__(device, rank, world_size)
        self.bucket_cap_mb, self.sync_batchnorm, self.shard_tables = bucket_cap_mb, sync_batchnorm, shard_tables
        self.ddp: DistributedDataParallel | None = None

    def wrap(self, model, *, first_inputs=None, loss_fn=None):
        self.model, self.ddp = apply_ddp(model, self.device, bucket_cap_mb=self.bucket_cap_mb,
                                         sync_batchnorm=self.sync_batchnorm, shard_tables=self.shard_tables)
        self._note_sharded_tables()
        return self.model

    @property
    def training_module(self):
        return self.ddp  # training steps go through the wrapper; evaluation and saving use the model

    def gradient_sync(self, sync: bool):
        return contextlib.nullcontext() if sync else self.ddp.no_sync()

    def drop_reducer(self) -> None:
        """Stops DDP's bucketed all-reduce: the wrapper calls its model directly from now on, and
        its reducer (which the logger holds too) is let go, with the process group and the
        gradient accumulators it keeps. For a step captured after DDP wrapped the model
        (``GraphDataParallel.from_ddp``), and before the process group is destroyed."""
        if self.ddp is not None and self.ddp.reducer is not None:
            self.ddp.forward = self.ddp.module.forward
            self.ddp.reducer = self.ddp.logger = None

    def describe(self) -> str:
        return f"{self.world_size} processes, DDP" + self._tables_note()
