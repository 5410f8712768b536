"""Scale-out on PyTorch's own distributed stack: process groups set up from the environment
torchrun provides; parallel strategies applied to a plain model (base.py says what a
strategy is; one file each: DDP, the step graph's own all-reduce, FSDP with CPU offload,
pipeline stages); activation checkpointing; and the launcher (torch.distributed.run)
behind ``gpuaccel train --gpus N``."""

from ..compiling import compile_arguments
from .base import SingleDevice, Strategy
from .checkpointing import apply_activation_checkpointing
from .data_parallel import DataParallel, apply_ddp, average_gradients, broadcast_state
from .distributed import Distributed
from .fsdp import Sharded
from .graph_data_parallel import GraphDataParallel
from .pipeline import PipelineParallel

__all__ = ["DataParallel", "Distributed", "GraphDataParallel", "PipelineParallel", "Sharded", "SingleDevice",
           "Strategy", "apply_activation_checkpointing", "apply_ddp", "average_gradients", "broadcast_state",
           "build_strategy"]


def build_strategy(config, dist: Distributed, device, *, precision, graph_step: bool, channels_last: bool) -> Strategy:
    """The strategy the settings ask for (``config`` is a TrainConfig, ``precision`` the resolved
    one): pipeline stages, FSDP (``shard``), data parallel with the all-reduce in the step
    graph (several processes and a whole-step graph), DDP (several processes), else one device."""
    from ..errors import GpuaccelError

    place = dict(device=device, rank=dist.rank, world_size=dist.world_size)
    if precision.loss_scaling and (config.pipeline_stages > 1 or config.shard):
        raise GpuaccelError("--shard and --pipeline-stages train in bf16 or fp32; fp16 loss scaling is not "
                            "supported with them (use --precision bf16 or fp32)")
    if config.pipeline_stages > 1:
        return PipelineParallel(
            **place, stages=config.pipeline_stages, microbatches=config.pipeline_microbatches,
            schedule=config.pipeline_schedule, split_points=config.split_points, batch_size=config.batch_size,
            eval_batch_size=config.eval_batch_size, channels_last=channels_last,
            compile_options=compile_arguments(config.compile_mode, config.tune_kernels) if config.compile else None,
            activation_checkpointing=config.activation_checkpointing,
            autocast=lambda: precision.autocast(device))
    if config.shard:
        return Sharded(**place, offload=config.offload == "cpu")
    if dist.active and graph_step:
        return GraphDataParallel(**place)
    if dist.active:
        return DataParallel(**place, bucket_cap_mb=config.ddp_bucket_mb, sync_batchnorm=config.sync_bn)
    return SingleDevice(**place)

