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
                    shard_unit_mb: float = DEFAULT_UNIT_MB, pipeline: dict | None = None) -> Strategy:
    """The one strategy chooser of both doors. ``name``: auto (DDP under torchrun, else one
    device), ddp or fsdp (FSDP2, ``offload``: its shards in host memory). ``pipeline``: the
    model split into pipeline stages instead (``PipelineParallel``'s arguments less the placement:
    stages, microbatches, schedule, ...). ``captured_step``: the step is one CUDA graph, so data
    parallel averages the gradients inside it instead of through DDP's hooks. ``shard_tables``:
    data parallel shards embedding tables updated in the backward pass across the processes
    (models/dlrm.py; their forward pass and state_dict() become collectives), else replicates
    them. ``overlap_gradients``: a captured step averages the gradients in buckets of
    ``bucket_cap_mb`` during the backward pass instead of in one all-reduce after it.
    ``shard_unit_mb``: FSDP's units (parallel/fsdp.py), whose weights are gathered in bf16 when
    the precision is bf16."""
    if name not in STRATEGIES:
        raise choice_error("strategy", name, STRATEGIES)
    dist, precision = placement.dist, placement.precision
    where = dict(device=placement.device, rank=dist.rank, world_size=dist.world_size)
    if pipeline is not None or name == "fsdp":
        if precision.loss_scaling:
            raise GpuaccelError(f"{'--pipeline-stages' if pipeline is not None else 'FSDP (--shard)'} trains in "
                                f"bf16 or fp32; fp16 loss scaling is not supported with it (use --precision bf16 "
                                f"or fp32)")
    if pipeline is not None:
        return PipelineParallel(**where, **pipeline, autocast=lambda: precision.autocast(placement.device),
                                autocast_dtype=precision.autocast_dtype)
    if name == "fsdp":
        bf16 = precision.autocast_dtype == torch.bfloat16
        return Sharded(**where, offload=offload, unit_mb=shard_unit_mb, param_dtype=torch.bfloat16 if bf16 else None)
    if dist.active and captured_step:
        return GraphDataParallel(**where, shard_tables=shard_tables,
                                 bucket_cap_mb=bucket_cap_mb if overlap_gradients else None)
    if dist.active:  # (ddp in one process: nothing to combine)
        return DataParallel(**where, bucket_cap_mb=bucket_cap_mb, sync_batchnorm=sync_batchnorm,
                            shard_tables=shard_tables)
    return SingleDevice(**where)


def holds_whole_model(config) -> bool:
    """Whether the strategy :func:`training_strategy` picks for a TrainConfig holds the whole model
    on each process's device (one device, data parallel, FSDP without offload) before it trains,
    rather than one pipeline stage or shards kept in host memory: a model can be built there."""
    return config.parallel.pipeline_stages == 1 and config.parallel.offload != "cpu"


def training_strategy(config, placement: Placement, *, captured_step: bool, channels_last: bool) -> Strategy:
    """:func:`choose_strategy` for a TrainConfig's parallel section: pipeline stages, FSDP
    (``shard``), or data parallel / one device."""
    parallel, runtime = config.parallel, config.runtime
    pipeline = None if parallel.pipeline_stages == 1 else dict(
        stages=parallel.pipeline_stages, microbatches=config.pipeline_microbatches,
        schedule=parallel.pipeline_schedule, split_points=parallel.split_points, batch_size=config.loop.batch_size,
        eval_batch_size=config.loop.eval_batch_size, channels_last=channels_last,
        compile_options=compile_arguments(runtime.compile_mode, runtime.tune_kernels) if runtime.compile else None,
        activation_checkpointing=config.model.activation_checkpointing)
    return choose_strategy(placement, "fsdp" if parallel.shard else "auto", captured_step=captured_step,
                           bucket_cap_mb=parallel.ddp_bucket_mb, sync_batchnorm=parallel.sync_bn,
                           offload=parallel.offload == "cpu", shard_tables=True,
                           overlap_gradients=parallel.overlap_gradients, shard_unit_mb=parallel.shard_unit_mb,
                           pipeline=pipeline)
