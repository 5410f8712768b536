"""The process group of a run, from the environment ``torchrun`` (torch.distributed.run) sets.

Without RANK/WORLD_SIZE in the environment a run is a single process and every helper
here is a no-op, so the training engine reads the same either way. The backend is NCCL
for GPUs and gloo for CPUs (so multi-process training is tested on CPUs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import GpuaccelError


@dataclass(frozen=True)
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    restart: int = 0  # how many times the elastic agent has restarted the group

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> "Distributed":
        env = os.environ
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)),
                   int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))

    def device(self, spec: str) -> torch.device:
        """This process's device: GPU ``local_rank`` when running on GPUs, else the CPU."""
        if spec == "cpu" or not torch.cuda.is_available():
            return torch.device("cpu")
        if spec not in ("auto", "cuda"):
            raise GpuaccelError(f"--device {spec} names one GPU, but this is a {self.world_size}-process run: "
                                f"each process takes GPU LOCAL_RANK; use --device auto or cuda")
        if self.local_rank >= torch.cuda.device_count():
            raise GpuaccelError(f"process {self.rank} wants GPU {self.local_rank}, but only "
                                f"{torch.cuda.device_count()} are visible here")
        return torch.device("cuda", self.local_rank)

    def init(self, device: torch.device) -> None:
        """Joins the process group (once)."""
        if not self.active or dist.is_initialized():
            return
        if not dist.is_available():
            raise GpuaccelError("this PyTorch build has no torch.distributed; multi-process training needs it")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = timedelta(minutes=10)
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        # The elastic agent's store outlives a failed attempt, and the process group's keys from
        # that attempt (peer addresses) stay in it: a restarted group read them and hung connecting
        # to dead processes (seen with gloo, torch 2.13). A prefix per attempt keeps them apart.
        store = dist.PrefixStore(f"gpuaccel/attempt_{self.restart}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)

    # collectives that are no-ops in a single process

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.active:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank if ``flag`` is true on any (so all ranks take the same branch)."""
        if not self.active:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()
