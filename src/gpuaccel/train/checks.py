"""Checks before anything trains: that every process of a run was given the same data and
model, that a built-in model reads the data, that the task can take the model's outputs, and
whether the whole step can be one CUDA graph. Each fails as one ``GpuaccelError`` (or returns
why), not as a traceback later."""

from __future__ import annotations

import functools

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import GpuaccelError
from ..models.registry import create_model, list_models
from ..runtime.capture import capture_obstacle
from ..tasks import call_model
from .config import DEFAULT_MODEL, TrainConfig
from .inputs import USER_DATA


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
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        if trainer.config.model.name not in list_models():  # a user's own model: its traceback is theirs to read
            raise
        raise model_data_mismatch(trainer.config.model.name, trainer.inputs, exc) from None
    finally:
        trainer.model.train(was_training)
        torch.backends.cudnn.benchmark = autotune
    trainer.task.check_batch(outputs, targets)
    if trainer.config.data.source == USER_DATA:  # (gpuaccel's readers check their labels as they read them)
        # a user's data held on the device is checked whole, so that a bad label in a later batch,
        # or only in the evaluation data, is this one line too and not a failure mid-run; data read
        # batch by batch is checked batch by batch on the host, as each arrives (one line naming it)
        for which, loader in (("training", trainer.train_loader), ("evaluation", trainer.eval_loader)):
            whole = getattr(loader, "tensors", None)
            if whole is None:
                if hasattr(loader, "host_check"):
                    loader.host_check = functools.partial(_check_host_batch, trainer.task, outputs, which)
                continue
            try:
                trainer.task.check_batch(outputs, trainer.task.split(whole)[1])
            except GpuaccelError as exc:
                raise GpuaccelError(f"the {which} data: {exc}") from None


def _check_host_batch(task, outputs, which: str, batch, where: str) -> None:
    try:
        task.check_batch(outputs, task.split(batch)[1])
    except GpuaccelError as exc:
        raise GpuaccelError(f"the {which} data, {where}: {exc}") from None


def whole_step_obstacle(config: TrainConfig, device: torch.device, precision) -> str | None:
    """None when the whole training step is captured as one CUDA graph, else why not: the
    settings ask for it with --compile-mode reduce-overhead (the model is then compiled in mode
    default, its kernels recorded by the step graph), and ``runtime.capture.capture_obstacle``
    finds nothing that prevents it (gradient accumulation is no obstacle: its micro-batches are
    inside the one step)."""
    if not (config.runtime.compile and config.runtime.compile_mode == "reduce-overhead"):
        return "it needs --compile --compile-mode reduce-overhead on a GPU"
    if not config.runtime.step_graph:
        return "not with --no-step-graph"
    return capture_obstacle(device, precision, sharded=config.parallel.shard,
                            pipelined=config.parallel.pipeline_stages > 1, sync_batchnorm=config.parallel.sync_bn,
                            checkpointed=config.model.activation_checkpointing)


def create_for_data(name: str, inputs, model_args: dict, required: tuple) -> torch.nn.Module:
    """``create_model`` with the arguments the data offer; a built-in model that cannot take
    them (the data do not give what it needs, or give more) is :func:`model_data_mismatch`."""
    try:
        return create_model(name, **model_args, required=required)
    except TypeError as exc:
        if name not in list_models():
            raise
        raise model_data_mismatch(name, inputs, exc) from None


def model_data_mismatch(model: str, inputs, exc: Exception) -> GpuaccelError:
    """A built-in model named for data it does not read (gpt for images, dlrm for ratings): one
    line naming both, and the model made for the data, instead of a traceback from inside the
    model (raised where it is built or at its first forward pass)."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    own = inputs.default_model or DEFAULT_MODEL
    return GpuaccelError(f"model {model} cannot read the {inputs.unit} of {inputs.name} ({first}); the model made for "
                         f"them is {own}, which training uses when no model is named ('gpuaccel models' lists the "
                         f"others)")
