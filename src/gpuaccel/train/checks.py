"""Checks before anything trains: that every process of a run was given the same data and
model, that the task can take the model's outputs, and whether the whole step can be one CUDA
graph. Each fails as one ``GpuaccelError`` (or returns why), not as a traceback later."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import GpuaccelError
from ..tasks import call_model
from .config import TrainConfig


def check_processes_agree(trainer) -> None:
    """Every process of a multi-process run was given the same data and builds the same
    model: else each would train on its own data set (and evaluate on a mix), or DDP would
    fail on parameters of different shapes. One broadcast of rank 0's digest, one all-reduce."""
    if not trainer.dist.active:
        return
    mine = f"{trainer.inputs.content_digest()}:{trainer.parameter_count}"
    first = trainer.dist.broadcast(mine)
    if trainer.dist.any(mine != first, trainer.device):
        whose = (f"this process (rank {trainer.dist.rank}) was given other "
                 f"{'data' if mine.split(':')[0] != first.split(':')[0] else 'model'} than rank 0"
                 if mine != first else "another process was given other data or model than this one (rank 0)")
        raise GpuaccelError(f"the processes of this run disagree: {whose} (here: "
                            f"{trainer.inputs.description.split(';')[0]}; a model of {trainer.parameter_count:,} "
                            f"parameters); give every process the same --data (a path each machine sees alike) "
                            f"and --model")


def check_task(trainer, batch) -> None:
    """The task against the model's outputs on a few samples of the first batch and that
    batch's targets, before anything trains: what the task cannot take is one error now,
    not a traceback an epoch later (skipped where the forward pass is a collective)."""
    inputs, targets = trainer.task.split(batch)
    if not trainer.strategy.local_forward or not all(torch.is_tensor(t) for t in tree_flatten(targets)[0]):
        return
    was_training, autotune = trainer.model.training, torch.backends.cudnn.benchmark
    trainer.model.eval()
    torch.backends.cudnn.benchmark = False  # (no algorithm search for a shape training never sees)
    try:
        with torch.no_grad(), trainer.precision.autocast(trainer.device):
            outputs = call_model(trainer.model, tree_map(lambda t: t[:2] if torch.is_tensor(t) else t, inputs))
    finally:
        trainer.model.train(was_training)
        torch.backends.cudnn.benchmark = autotune
    trainer.task.check_batch(outputs, targets)


def whole_step_obstacle(config: TrainConfig, device: torch.device, precision) -> str | None:
    """None when the whole training step is captured as one CUDA graph (runtime/capture.py),
    else what prevents it. It needs --compile-mode reduce-overhead on a GPU and a step that is
    the same kernels every time, on one device's whole model (gradient accumulation included:
    its micro-batches are inside the one step)."""
    if not (config.compile and config.compile_mode == "reduce-overhead") or device.type != "cuda":
        return "it needs --compile --compile-mode reduce-overhead on a GPU"
    obstacles = {"--no-step-graph": not config.step_graph, "--pipeline-stages": config.pipeline_stages > 1,
                 "--shard": config.shard, "--sync-bn": config.sync_bn, "fp16 loss scaling": precision.loss_scaling,
                 "--activation-checkpointing": config.activation_checkpointing}
    found = [name for name, present in obstacles.items() if present]
    return f"not with {', '.join(found)}" if found else None
