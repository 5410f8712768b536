"""Which parallel strategy a process takes part in training with (``gpuaccel.parallel`` holds
one file per strategy), chosen here for ``Trainer``'s settings and ``Accelerator``'s argument."""

from __future__ import annotations

import torch

from ..compiling import compile_arguments
from ..errors import GpuaccelError, choice_error
from ..parallel import DataParallel, GraphDataParallel, PipelineParallel, Sharded, SingleDevice, Strategy
from ..parallel.fsdp import DEFAULT_UNIT_MB
from .placement import Placement

STRATEGIES = ("auto", "ddp", "fsdp")


def choose_strategy(placement: Placement, name: str = "auto", *, captured_step: bool = False,
                    bucket_cap_mb: float = 25.0, sync_batchnorm: bool = False, offload: bool = False,
                    shard_tables: bool = False, overlap_gradients: bool = False,
                    shard_unit_mb: float = DEFAULT_UNIT_MB) -> Strategy:
    """``name``: auto (DDP under torchrun, else one device), ddp or fsdp (FSDP2, ``offload``: its
    shards in host memory). ``captured_step``: the step is one CUDA graph, so data parallel
    averages the gradients inside it instead of through DDP's hooks. ``shard_tables``: data
    parallel shards embedding tables updated in the backward pass across the processes (models/dlrm.py;
    their forward pass and state_dict() become collectives), else replicates them.
    ``overlap_gradients``: a captured step averages the gradients in buckets of ``bucket_cap_mb``
    during the backward pass instead of in one all-reduce after it. ``shard_unit_mb``: FSDP's units
    (parallel/fsdp.py), whose weights are gathered in bf16 when the precision is bf16."""
    if name not in STRATEGIES:
        raise choice_error("strategy", name, STRATEGIES)
    dist = placement.dist
    where = dict(device=placement.device, rank=dist.rank, world_size=dist.world_size)
    if name == "fsdp":
        if placement.precision.loss_scaling:
            raise GpuaccelError("FSDP (--shard) trains in bf16 or fp32; fp16 loss scaling is not supported with it "
                                "(use --precision bf16 or fp32)")
        bf16 = placement.precision.autocast_dtype == torch.bfloat16
        return Sharded(**where, offload=offload, unit_mb=shard_unit_mb, param_dtype=torch.bfloat16 if bf16 else None)
    if dist.active and captured_step:
        return GraphDataParallel(**where, shard_tables=shard_tables,
                                 bucket_cap_mb=bucket_cap_mb if overlap_gradients else None)
    if dist.active:  # (ddp in one process: nothing to combine)
        return DataParallel(**where, bucket_cap_mb=bucket_cap_mb, sync_batchnorm=sync_batchnorm,
                            shard_tables=shard_tables)
    return SingleDevice(**where)


def training_strategy(config, placement: Placement, *, captured_step: bool, channels_last: bool) -> Strategy:
    """The strategy a TrainConfig asks for: pipeline stages, FSDP (``shard``), or
    :func:`choose_strategy`'s data parallel or one device."""
    if config.parallel.pipeline_stages > 1:
        if placement.precision.loss_scaling:
            raise GpuaccelError("--pipeline-stages trains in bf16 or fp32; fp16 loss scaling is not supported with "
                                "it (use --precision bf16 or fp32)")
        dist, precision, device = placement.dist, placement.precision, placement.device
        return PipelineParallel(
            device=device, rank=dist.rank, world_size=dist.world_size, stages=config.parallel.pipeline_stages,
            microbatches=config.pipeline_microbatches, schedule=config.parallel.pipeline_schedule,
            split_points=config.parallel.split_points, batch_size=config.loop.batch_size,
            eval_batch_size=config.loop.eval_batch_size,
            channels_last=channels_last,
            compile_options=compile_arguments(config.runtime.compile_mode,
                                              config.runtime.tune_kernels) if config.runtime.compile else None,
            activation_checkpointing=config.model.activation_checkpointing,
            autocast=lambda: precision.autocast(device), autocast_dtype=precision.autocast_dtype)
    return choose_strategy(placement, "fsdp" if config.parallel.shard else "auto", captured_step=captured_step,
                           bucket_cap_mb=config.parallel.ddp_bucket_mb, sync_batchnorm=config.parallel.sync_bn,
                           offload=config.parallel.offload == "cpu", shard_tables=True,
                           overlap_gradients=config.parallel.overlap_gradients,
                           shard_unit_mb=config.parallel.shard_unit_mb)
