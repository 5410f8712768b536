"""The process group of a run, from the environment ``torchrun`` (torch.distributed.run) sets,
or, for the tasks of a Slurm job step (``srun``, one task per GPU), from Slurm's.

Without RANK/WORLD_SIZE (or a Slurm step of several tasks) in the environment a run is a
single process and every helper here is a no-op, so the training engine reads the same either
way. The backend is NCCL for GPUs and gloo for CPUs (so multi-process training is tested on
CPUs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import GpuaccelError


class PendingFlag:
    """A device flag on its way to the host: copied to pinned memory as soon as it is computed,
    so that reading it waits for the work queued before it, not for the whole queue (as
    ``.item()`` on the device value would)."""

    def __init__(self, value: torch.Tensor):
        self._ready = None
        if value.is_cuda:
            self._host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self._host.copy_(value, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = value

    def result(self) -> bool:
        if self._ready is not None:
            self._ready.synchronize()
        return bool(self._host.item())


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
        for key, value in slurm_environment(env).items():
            env.setdefault(key, value)  # what torch's env:// rendezvous reads
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
        stop_with_launcher()
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
        return self.start_any(flag, device).result()

    def start_any(self, flag: bool, device: torch.device) -> "PendingFlag":
        """:meth:`any` begun: the all-reduce queued, its answer read later with ``result()``,
        which then need not wait for the work queued after it."""
        value = torch.full((1,), 1.0 if flag else 0.0, device=device)  # (a fill: no copy from the host)
        if self.active:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return PendingFlag(value)

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.active:
            return [obj]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def on_main(self, make, share=lambda made: None):
        """``make()`` on rank 0: returns what it made (None elsewhere) and rank 0's
        ``share(made)`` on every rank, in one broadcast. A user error ``make`` raises is raised
        on every rank: rank 0 stopping alone would leave the others waiting in their next
        collective, which NCCL gives up only at the process group's timeout."""
        made, outcome = None, None
        if self.is_main:
            try:
                made = make()
                outcome = ("made", share(made))
            except GpuaccelError as exc:
                if not self.active:
                    raise
                outcome = ("error", str(exc))
        kind, value = self.broadcast(outcome)
        if kind == "error":
            raise GpuaccelError(value)
        return made, value

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()


SLURM_PORT_BASE = 29500  # + the job id modulo 1000: steps of different jobs on one node do not collide


def slurm_environment(env) -> dict[str, str]:
    """torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) for a task
    of a Slurm job step of several tasks (``srun --ntasks-per-node=GPUS python -m gpuaccel train
    ...``), read from the step's SLURM_* variables; {} where torchrun (or a user) has set RANK, or
    this is not such a task. The step's variables, not the job's: a batch script itself is one
    process even in an allocation of many tasks. MASTER_ADDR and MASTER_PORT, where set, are kept."""
    if "RANK" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_STEP_NUM_TASKS", "1")) < 2:
        return {}
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
    if not nodes:
        raise GpuaccelError("a Slurm step of several tasks without SLURM_STEP_NODELIST: set MASTER_ADDR to the "
                            "first node's address, or start the processes with torchrun")
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_STEP_NUM_TASKS"],
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0"), "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodes),
            "MASTER_PORT": env.get("MASTER_PORT") or str(SLURM_PORT_BASE + int(env.get("SLURM_JOB_ID", "0")) % 1000)}


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: "gpu[07-09,12],cpu1" -> "gpu07" (what ``scontrol
    show hostnames`` prints first, without needing scontrol)."""
    head = nodelist.strip().split(",", 1)[0] if "[" not in nodelist.split(",", 1)[0] else nodelist.strip()
    if "[" not in head:
        return head
    prefix, rest = head.split("[", 1)
    ranges, suffix = rest.split("]", 1)
    first = ranges.split(",", 1)[0].split("-", 1)[0]
    return prefix + first + suffix.split(",", 1)[0]


def stop_with_launcher() -> None:
    """Under torchrun: this process is sent SIGTERM when its launcher dies, as when the launcher
    ends it itself (a run then checkpoints and stops). A launcher killed with SIGKILL cannot pass
    its own signal on, and its workers trained on, holding the run directory's lock (Linux only:
    prctl's PR_SET_PDEATHSIG)."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    launcher = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher:  # (it died before the request took effect)
        os.kill(os.getpid(), signal.SIGTERM)
