"""Fully sharded data parallel (FSDP2: ``torch.distributed.fsdp.fully_shard``) applied to a
plain model, for models whose parameters, gradients and optimizer state do not fit on one
device together.

Each process keeps 1/N of every parameter, gradient and optimizer state. Consecutive outermost
residual blocks (the units of activation checkpointing) are grouped into FSDP units of at least
``--shard-unit-mb`` of parameters: a unit's parameters are all-gathered just before its forward
and backward pass and freed after, and its gradients are reduce-scattered as soon as they are
ready, so only about one unit is whole at a time and communication overlaps compute. The rest
of the model (stem, head) is the root unit.

Checkpoints hold full, unsharded state dicts (gathered to rank 0), so they load into a plain
model for evaluation, export or a run with another number of processes. ``--shard`` also
works in one process (a process group of one is created), which is useful with CPU offload
(``--offload cpu``) and activation checkpointing.
"""

from __future__ import annotations

import atexit
import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import GpuaccelError
from .base import Strategy, consecutive_groups, refuse_backward_updates, shortfall_of_batches
from .checkpointing import _outermost_blocks


def ensure_process_group(device: torch.device) -> None:
    """A process group must exist for FSDP; a single process gets a group of one."""
    if not dist.is_available():
        raise GpuaccelError("--shard needs torch.distributed, which this PyTorch build does not have")
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not (dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()):
        raise GpuaccelError(f"--shard needs the {backend} process-group backend, which this PyTorch build lacks")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    atexit.register(dist.destroy_process_group)


DEFAULT_UNIT_MB = 80.0  # (--shard-unit-mb)


def fsdp_units(model: nn.Module, unit_bytes: float) -> list[list[nn.Module]]:
    """``model``'s outermost blocks in order, consecutive ones grouped until a group holds at
    least ``unit_bytes`` of parameters (0: one block a unit)."""
    return consecutive_groups(list(_outermost_blocks(model)), unit_bytes,
                              lambda block: sum(p.numel() * p.element_size() for p in block.parameters()))


def apply_fsdp(model: nn.Module, device: torch.device, units: list[list[nn.Module]], *, offload: bool = False,
               param_dtype: torch.dtype | None = None) -> nn.Module:
    """Shards ``model`` in place over all processes of the default group; returns it.

    ``units``: the groups of blocks sharded together (:func:`fsdp_units`; ``--shard``: consecutive
    outermost blocks of at least 80 MiB of parameters). Each unit costs host work in every
    forward and backward pass (its hooks, the copies in and out of its all-gather, its
    collectives), so small units make that work, not the GPU, set the step's pace: a 124 M GPT
    of 28 MB blocks scaled far worse with a unit per block than with units of three
    (docs/results.md, "Several GPUs"). The last unit stays gathered after its
    forward pass: its backward pass comes next.

    ``param_dtype``: the weights are gathered and computed with in this dtype (bf16 runs: half the
    bytes of fp32, no casts under autocast, and faster than fp32 gathers); gradients are reduced in fp32 into the fp32 shards.

    ``offload``: the sharded parameters, their gradients and the optimizer state stay in
    pinned host memory; each unit's parameters are copied to the GPU for its forward and
    backward pass, gradients go back to the host, and the optimizer step runs on the CPU.
    GPU memory then holds about one unit's parameters plus the activations."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if offload and device.type != "cuda":
        raise GpuaccelError("--offload cpu moves parameters out of GPU memory; this run is on the CPU already")
    ensure_process_group(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    common = dict(mesh=mesh, offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy(),
                  mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
                  if param_dtype is not None else MixedPrecisionPolicy())
    for i, unit in enumerate(units):
        fully_shard(unit if len(unit) > 1 else unit[0], reshard_after_forward=i < len(units) - 1, **common)
    fully_shard(model, **common)
    return model


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None):
    """(model state, optimizer state or None) unsharded on the CPU of rank 0 (empty elsewhere).
    A collective: every process must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_state = get_model_state_dict(model, options=_options(cpu_offload=True))
    optimizer_state = None if optimizer is None else \
        get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    return model_state, optimizer_state


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_state: dict,
                    optimizer_state: dict | None) -> None:
    """Loads full (unsharded) state dicts, which every process has read, into the sharded model."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, model_state, options=_options())
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=_options())


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """This process's shards of the model's (and optimizer's) state, as DCP saves and fills them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def save_sharded(path, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict) -> None:
    """Writes ``model``'s (and ``optimizer``'s) sharded state with torch.distributed.checkpoint:
    a folder in which each process writes its own shards, nothing gathered. The folder is
    written beside ``path`` and renamed into place once every process has finished, so an
    interrupted save leaves the previous one whole. ``extra`` (small, unsharded state, e.g. a
    scheduler's) goes into the folder from rank 0. A collective: every process calls it."""
    import shutil
    from pathlib import Path

    import torch.distributed.checkpoint as dcp

    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if dist.get_rank() == 0 and partial.exists():
        shutil.rmtree(partial)
    dist.barrier()
    dcp.save(_sharded_state(model, optimizer), checkpoint_id=str(partial))
    if dist.get_rank() == 0:
        torch.save(extra, partial / "extra.pt")
        previous = path.with_name(path.name + ".previous")
        if path.exists():
            path.rename(previous)
        partial.rename(path)
        shutil.rmtree(previous, ignore_errors=True)
    dist.barrier()


def load_sharded(path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """Reads what :func:`save_sharded` wrote into the sharded ``model`` (and ``optimizer``), each
    process its own shards (resharded if the number of processes changed); returns ``extra``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = _sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    return torch.load(f"{path}/extra.pt", map_location="cpu", weights_only=True)


class Sharded(Strategy):
    """FSDP2 over all processes (one also works): parameters, gradients and optimizer state
    split; a run's checkpoint keeps them as each process's shards (torch.distributed.checkpoint,
    as ``Accelerator.save`` writes them), its final model.pt and best.pt gathered whole to rank 0."""

    name = "fully sharded data parallel (FSDP)"
    collective_state = True
    shards_state = True
    local_forward = False  # (a collective across the processes)

    def __init__(self, device: torch.device, rank: int, world_size: int, *, offload: bool = False,
                 unit_mb: float = DEFAULT_UNIT_MB, param_dtype: torch.dtype | None = None):
        super().__init__(device, rank, world_size)
        self.offload, self.unit_mb, self.param_dtype = offload, unit_mb, param_dtype
        self.units: list[list[nn.Module]] | None = None  # (once wrapped)
        self.places_parameters = offload  # the shards stay in pinned host memory

    def fuses(self, optimizer: str) -> bool:
        # DTensor has sharding rules for the fused Adam and AdamW kernels, not for fused SGD's;
        # offloaded shards are updated by the CPU
        return optimizer in ("adam", "adamw") and not self.offload

    def wrap(self, model, *, first_inputs=None, loss_fn=None):
        refuse_backward_updates(model, "FSDP (--shard)")
        self.units = fsdp_units(model, self.unit_mb * 2**20)
        self.model = apply_fsdp(model, self.device, self.units, offload=self.offload, param_dtype=self.param_dtype)
        return self.model

    def gradient_sync(self, sync: bool):
        self.model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def gather_state(self, optimizer, to_host=None):
        return full_state(self.model, optimizer)  # (gathered into new host memory: ``to_host`` is not used)

    def save_shards(self, path, optimizer) -> None:
        """Each process writes its shards of the model and ``optimizer`` into the folder ``path``."""
        save_sharded(path, self.model, optimizer, {})

    def load_shards(self, path, optimizer) -> None:
        """Each process reads its shards from what :meth:`save_shards` wrote (resharded if the
        number of processes changed)."""
        load_sharded(path, self.model, optimizer)

    def load_state(self, optimizer, model_state, optimizer_state):
        load_full_state(self.model, optimizer, model_state, optimizer_state)

    def blank_evaluation_passes(self, batches):
        return shortfall_of_batches(self.device, batches) if self.world_size > 1 else 0  # (forward: a collective)

    def describe(self) -> str:
        gathers = ", bf16 gathers" if self.param_dtype == torch.bfloat16 else ""
        offload = " with CPU offload" if self.offload else ""
        units = "units" if self.units is None else f"{len(self.units)} units"
        return f"{self.world_size} process(es), FSDP ({units}{gathers}){offload}"
