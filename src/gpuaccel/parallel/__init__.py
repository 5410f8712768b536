"""Scale-out on PyTorch's own distributed stack: process groups set up from the environment
torchrun provides; DistributedDataParallel, FSDP (fsdp.py, with CPU offload), pipeline
stages (pipeline.py) and activation checkpointing applied to a plain model; and the
launcher (torch.distributed.run) behind ``gpuaccel train --gpus N``."""

from .distributed import Distributed
from .data_parallel import apply_ddp, average_gradients, broadcast_state
from .checkpointing import apply_activation_checkpointing

__all__ = ["Distributed", "apply_activation_checkpointing", "apply_ddp", "average_gradients", "broadcast_state"]
