"""Scale-out on PyTorch's own distributed stack: process groups set up from the environment
torchrun provides; parallel strategies applied to a plain model (base.py says what a
strategy is; one file each: DDP, the step graph's own all-reduce, FSDP with CPU offload,
pipeline stages); activation checkpointing; and the launcher (torch.distributed.run)
behind ``gpuaccel train --gpus N``. ``gpuaccel.runtime.strategy`` chooses one for a run."""

from .base import SingleDevice, Strategy
from .checkpointing import apply_activation_checkpointing
from .data_parallel import DataParallel, apply_ddp, average_gradients, broadcast_state
from .distributed import Distributed
from .fsdp import Sharded
from .graph_data_parallel import GraphDataParallel
from .pipeline import PipelineParallel

__all__ = ["DataParallel", "Distributed", "GraphDataParallel", "PipelineParallel", "Sharded", "SingleDevice",
           "Strategy", "apply_activation_checkpointing", "apply_ddp", "average_gradients", "broadcast_state"]
