"""The training engine: one loop, read top to bottom in ``fit``.

A ``Trainer`` owns the model, the data loaders, the optimizer and the run directory; a
task (``gpuaccel.tasks``) owns what is specific to the problem: how a batch splits into
inputs and targets, the loss, the metrics and how evaluation runs the model. Per step it
does a forward pass under autocast, a backward pass (loss-scaled for fp16), and every
``grad_accum`` micro-batches an optimizer and schedule step. Losses and metrics are
accumulated on the device and read only at evaluations, so the step never waits for the
GPU. Evaluations, checkpoints and the stop conditions (epochs, time limit, a target
value of any metric) happen between optimizer steps.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import itertools
import json
import math
import os
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from .. import __version__
from ..compiling import compile_arguments, compile_workers_unless_cached
from ..data import ImageDataset, resolved_spec
from ..data.augment import parse_size_schedule, resize
from ..device import device_name, resolve_device, resolve_precision, synchronize
from ..errors import GpuaccelError
from ..files import MetricsFile, RunLock, remove_stale_temporaries
from ..models import create_model
from ..models.registry import add_search_dir, model_source_dir
from ..models.structure import apply_structure
from ..monitor import DataWaitMeter, GpuSampler
from ..monitor.phases import PhaseClock
from ..monitor.profiling import ScalarLog, StepProfiler
from ..parallel import Distributed, Strategy, apply_activation_checkpointing, build_strategy
from ..tasks import CustomTask, MetricTracker, Task, call_model, create_task
from ..tasks.base import leading_size
from . import checkpoint
from .config import TrainConfig
from .ema import WeightAverage
from .inputs import USER_DATA, open_inputs
from .optim import build_optimizer, build_scheduler
from .progress import Progress
from .step_graph import StepGraph, batch_shapes

CHECKPOINT = "checkpoint.pt"
FINAL_MODEL = "model.pt"


class Stop(Exception):
    """Raised by a signal handler so that SIGTERM stops training like Ctrl-C does."""


class Trainer:
    def __init__(self, config: TrainConfig | None = None, *, model: nn.Module | None = None, train_data=None,
                 eval_data=None, task: Task | str | None = None, loss_fn=None, metrics: dict | None = None,
                 dataset=None, structure: dict | None = None, data_init: bool = True, quiet: bool = False,
                 strategy: Strategy | None = None):
        """``config``: the settings (``TrainConfig()``'s defaults when None).

        What to train on: ``config.data`` (a gpuaccel data spec), ``dataset`` (a data set a
        gpuaccel reader made), or ``train_data`` (and ``eval_data``): a map-style torch Dataset,
        a DataLoader, or a tuple/dict of tensors; without ``eval_data`` a ``val_split`` share is
        held out. What to train: ``config.model`` from the registry, or ``model`` (any
        nn.Module; with ``structure``, it is ``config.model`` reshaped to those layer widths,
        e.g. pruned). What to minimise: ``task`` (a ``gpuaccel.tasks`` object or name; image
        data default to classification) or ``loss_fn(outputs, targets)``, with ``metrics``
        ({name: torchmetrics metric or callable (outputs, targets) -> number}) reported at
        each evaluation. ``data_init=False`` skips a model's data-dependent initialisation.
        ``strategy``: a ``gpuaccel.parallel.Strategy`` instead of the one the settings imply."""
        setup_start = time.perf_counter()
        self.phases = PhaseClock()
        self.config = config = (config or TrainConfig()).replace().validate()  # (a copy: it records the run)
        self._compile_mode = config.compile_mode if config.compile else None
        self.quiet = quiet
        # one process, or one of several started by torchrun: then each takes its shard of the data
        self.dist = Distributed.from_env()
        self.device = self.dist.device(config.device) if self.dist.active else resolve_device(config.device)
        self.dist.init(self.device)
        self.precision = resolve_precision(config.precision, self.device)
        if self.device.type == "cuda":
            torch.zeros((), device=self.device)  # CUDA's context now, so that its cost is charged here
        self.phases.mark("device (CUDA initialisation)")
        if train_data is None and dataset is None:
            config.data = resolved_spec(config.data)  # recorded so that a resume works from anywhere
        self.inputs = open_inputs(config, dataset=dataset, train_data=train_data, eval_data=eval_data,
                                  dist=self.dist)
        if train_data is not None and self.inputs.images is None:
            config.data = USER_DATA
        self.phases.mark("reading the data")
        self.dataset = self.inputs.images  # a gpuaccel image data set, or None for a user's data
        self.task = _resolve_task(config, self.inputs, task, loss_fn, metrics)
        if config.target_metric is not None:
            self.task.check_target(config.target_metric[0])
        if self.inputs.classes is not None and len(self.inputs.classes) < 2:
            raise GpuaccelError(f"{self.inputs.name} has one class ({self.inputs.classes[0]!r}); a classifier needs "
                                f"two or more to learn anything")

        torch.manual_seed(config.seed)
        self.model_args = {**self.inputs.model_args, **(config.model_args or {})}  # (recorded: rebuilds the model)
        self.structure = structure
        model = self._build_model(model, structure)
        if config.activation_checkpointing and config.pipeline_stages == 1:  # (a pipeline wraps its stage's blocks)
            apply_activation_checkpointing(model)
        self.model = model
        self.parameter_count = sum(p.numel() for p in model.parameters())
        if config.batch_size == 1 and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            raise GpuaccelError(f"--batch-size 1 cannot train {config.model}: its batch norms need two or more "
                                f"samples per batch; use a larger --batch-size")
        has_conv = any(isinstance(m, nn.Conv2d) for m in self.model.modules())
        self.channels_last = (self.device.type == "cuda" and has_conv) if config.channels_last is None \
            else config.channels_last
        # FSDP shards contiguous parameters only; the inputs alone are then channels_last
        layout = torch.channels_last if self.channels_last and not config.shard else torch.preserve_format
        # CUDA graphs: the whole step as one graph where it can be captured (see step_graph.py), else
        # torch.compile's graphs of the forward and backward passes. Decided here, once, and said.
        self.step_graph_off = whole_step_obstacle(config, self.device, self.precision)
        whole_step = self.step_graph_off is None
        # how this process takes part: one device, DDP, data parallel inside the step graph, FSDP
        # or a pipeline stage (parallel/); the loop below never asks which
        self.strategy = strategy or build_strategy(config, self.dist, self.device, precision=self.precision,
                                                   graph_step=whole_step, channels_last=self.channels_last)
        # a pipeline stage or FSDP with CPU offload puts the parameters where they belong, part by part
        self.on_host = self.strategy.places_parameters
        self.model.to(torch.device("cpu") if self.on_host else self.device, memory_format=layout)
        self.phases.mark("building and placing the model")
        if config.deterministic:
            # cuDNN's autotuner times its candidates, so which kernel wins, and its rounding, varies
            # from process to process; cuBLAS needs a fixed workspace before its first call
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        elif self.device.type == "cuda":
            torch.backends.cudnn.benchmark = config.cudnn_benchmark  # (shapes are fixed: each is timed once)

        self.mean, self.std = self.inputs.mean, self.inputs.std
        self.data_rank, self.data_ranks = self.strategy.data_rank, self.strategy.data_ranks
        self.train_loader, self.eval_loader = self.inputs.loaders(
            config, device=self.device, dtype=self.precision.input_dtype, channels_last=self.channels_last,
            rank=self.data_rank, world_size=self.data_ranks)
        if len(self.train_loader) == 0:
            raise GpuaccelError(f"{self.inputs.train_samples} training samples make no batch of "
                                f"--batch-size {config.batch_size} per process")
        if data_init and hasattr(self.model, "data_init") and self.inputs.init_sample is not None:
            sample = self.inputs.init_sample(self.train_loader)  # for a data-dependent initialisation
            if sample is not None:
                self.model.data_init(*(t.cpu() if self.on_host else t for t in sample))
        self._example_inputs = None  # one sample's inputs (set at the first step): blanks for sharded evaluation
        self.model = self.strategy.wrap(
            self.model, loss_fn=self.task.loss,
            first_inputs=lambda: self.task.split(next(iter(self.train_loader.batches(0))))[0])
        self.collective_state = self.strategy.collective_state  # checkpoints gathered from every process
        self.counts_metrics = self.strategy.counts_metrics  # where losses are computed
        self.ema = WeightAverage(self.model, config.ema) if config.ema else None
        if whole_step:
            # the step graph captures inductor's kernels itself: torch.compile's own CUDA graphs
            # (mode reduce-overhead) inside it would be graphs within a graph
            self._compile_mode = "default"
        self.forward = self.strategy.training_forward(self._compiled)
        compile_for_eval = self._compiled if config.compile_eval else (lambda module: module)
        forward_for_eval = self.forward if config.compile_eval else self.strategy.training_forward(compile_for_eval)
        self.eval_forward = self.strategy.eval_forward(compile_for_eval, forward_for_eval,
                                                       self.ema.module if self.ema else None)

        self.steps_per_epoch = math.ceil(len(self.train_loader) / config.grad_accum)
        self.optimizer = build_optimizer(self.model, config, self.device, fused=self.strategy.fused_optimizer,
                                         capturable=whole_step)
        self.scheduler = build_scheduler(self.optimizer, config, self.steps_per_epoch)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision.loss_scaling)
        self.step_graph = StepGraph(
            self.model, self.forward, self.optimizer, loss_fn=self.task.loss,
            autocast=lambda: self.precision.autocast(self.device, cache=False), grad_clip=config.grad_clip,
            ema=self.ema, reduce_gradients=self.strategy.reduce_gradients) if whole_step else None
        self.metric_tracker = MetricTracker(self.task, self.device)

        # where in the data order training stands, and what it has achieved so far
        self.epoch = 0
        self.batch_in_epoch = 0
        self.global_step = 0
        self.train_seconds = 0.0
        self.samples_seen = 0
        self.best_metrics: dict[str, float] = {}
        self.last_eval: dict = {}
        self.evaluated_at = 0  # the global step of the last finished evaluation
        self.resumed = False
        self.time_to_target: float | None = None
        self.run_dir: Path | None = None
        self._lock: RunLock | None = None
        self.warmup_seconds = 0.0
        self.setup_seconds = time.perf_counter() - setup_start
        self.phases.mark("loaders, optimizer, parallel strategy")

    def _build_model(self, model: nn.Module | None, structure: dict | None) -> nn.Module:
        """The model to train, and how a run records it: a registry name or factory spec (rebuilt
        on resume, export and inference), or "object:Class" for a module passed in, which a
        resume must be given again."""
        config = self.config
        if model is None:
            if config.data == USER_DATA and ":" not in config.model:
                raise GpuaccelError("with train_data= from Python, pass the model too (model=...), or name a "
                                    "package.module:factory as the config's model")
            if config.model.startswith("object:"):
                raise GpuaccelError(f"this run trained a model passed as an object ({config.model[7:]}); pass "
                                    f"the same model again (model=...)")
            add_search_dir(config.model_path)
            model = create_model(config.model, **self.model_args, required=tuple(config.model_args or ()))
            if config.model_path is None:
                config.model_path = model_source_dir(config.model)
            if structure:
                apply_structure(model, structure)
        elif structure is None:  # (with a structure it is config.model, reshaped)
            if not isinstance(model, nn.Module):
                raise GpuaccelError(f"model= takes a torch.nn.Module, not {type(model).__name__}")
            config.model, config.model_path = f"object:{type(model).__qualname__}", None
        return model

    def _compiling(self, inputs, targets):
        """Around the steps that compile the model (gpuaccel.compiling.compile_workers_unless_cached):
        what identifies the compiled graphs is the configuration (less the seed and where the run
        writes), the model, its first batch's shapes and the device."""
        if self._compile_mode is None:
            return contextlib.nullcontext()
        config = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)
                  if f.name != "seed" and f.metadata.get("section") != "logging"}
        shapes = [(tuple(t.shape), str(t.dtype)) for t in tree_flatten((inputs, targets))[0] if torch.is_tensor(t)]
        return compile_workers_unless_cached([config, repr(self.model), shapes, device_name(self.device)])

    def _compiled(self, module: nn.Module):
        if self._compile_mode is None:
            return module
        # compiled kernels are cached on disk (gpuaccel.caches.use_compile_cache), so only the
        # first run on a machine pays for them
        # Static shapes: a short last evaluation batch gets a graph of its own rather than making
        # Dynamo recompile the model for a symbolic batch size (CUDA graphs record fixed shapes).
        return torch.compile(module, dynamic=False, **compile_arguments(self._compile_mode, self.config.tune_kernels))

    @property
    def jpeg_decoder(self) -> str | None:
        """How a streaming loader decodes (e.g. "nvjpeg (direct), 0% pillow"); None for other loaders."""
        return getattr(self.train_loader, "decoder", None)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict:
        """Trains until a stop condition; returns the summary (also written to summary.json)."""
        cfg = self.config
        main = self.dist.is_main
        self.run_dir = self.run_dir or Path(self.dist.broadcast(str(self._make_run_dir()) if main else None))
        self._lock_run_dir(self.run_dir)  # (a resumed trainer holds it already)
        metrics = MetricsFile(self.run_dir / "metrics.jsonl")
        progress = Progress(math.ceil(cfg.epochs * self.steps_per_epoch), self.global_step, self.quiet or not main)
        progress.log(f"{self.inputs.description}; task {self.task.name}; model {cfg.model} "
                     f"({self.parameter_count:,} parameters) on "
                     f"{device_name(self.device)} [{self.device}], {self.precision.name}; run dir {self.run_dir}"
                     + (f"; {self.strategy.describe()}" if self.strategy.describe() else "")
                     + (f", {self.config.batch_size} samples each per step" if self.data_ranks > 1 else "")
                     + ("; each training step one CUDA graph (inductor's kernels inside it)"
                        if self.step_graph is not None else "")
                     + (f"; no whole-step CUDA graph: {self.step_graph_off}"
                        if self.step_graph is None and self._cuda_graphs else "")
                     + (f"; JPEG decoding: {self.jpeg_decoder}" if self.jpeg_decoder else ""))
        if self.inputs.classes:  # folder names sort as strings: "10" before "2"; say which index is which
            shown = [f"{i}={name}" for i, name in enumerate(self.inputs.classes[:20])]
            more = len(self.inputs.classes) - len(shown)
            progress.log("classes (index=name): " + ", ".join(shown) + (f", ... ({more} more)" if more else ""))

        first_batches = None  # the first epoch's, started before the warm-up: a streaming loader fills meanwhile
        if self.config.compile or self.device.type == "cuda" or self.strategy.needs_warm_up:
            first_batches = iter(self.train_loader.batches(self.epoch, start=self.batch_in_epoch))
            first = next(first_batches, None)
            if first is not None:
                first_batches = itertools.chain([first], first_batches)
            self.phases.mark("run directory")
            self.warmup_seconds = self.warm_up(batch=first)
            self.phases.mark("warm-up (compiling, autotuning, graph capture, a first evaluation)")
            progress.log(f"warm-up (compilation, cuDNN autotuning) took {self.warmup_seconds:.1f} s; "
                         f"not counted as training time")
        loss_sum = torch.zeros((), device=self.device)  # summed on the device, read at evaluations
        samples_since_eval, seconds_at_eval = 0, self.train_seconds
        trained_before = self.train_seconds
        last_checkpoint = time.perf_counter()
        stopped_by = None
        self.phases.mark("run directory")
        wall_start = time.perf_counter()
        previous_handler = _install_sigterm()
        self.model.train()
        stepped_at = (self.epoch, self.batch_in_epoch, self.samples_seen)  # the position the weights correspond to
        sampler = GpuSampler(self.run_dir / f"gpu{'' if main else self.dist.rank}.jsonl",
                             [self.device.index or 0] if self.device.type == "cuda" else [],
                             origin=wall_start) if cfg.monitor else None
        if sampler is not None:
            sampler.start()
        data_wait = DataWaitMeter(self.device)
        profiler = StepProfiler(self.run_dir, self.device) if cfg.profile and main else None
        scalars = ScalarLog(self.run_dir) if cfg.tensorboard and main else None
        wall_at_eval = 0.0
        # Compilation leaves millions of long-lived objects behind; the collector's full passes
        # over them would stall the training and pipeline threads mid-epoch. Frozen, they are
        # skipped (as long-running servers do); the garbage made before is collected first.
        # Whatever was frozen before is thawed with them at the end: freezing is only a hint to
        # the collector, and Python 3.12 itself starts with 375 objects frozen, so leaving the
        # freeze to a caller who had frozen objects turned it off in every 3.12 process.
        gc.collect()
        gc.freeze()

        def evaluate_and_log() -> dict:
            """Evaluates, appends the record to metrics.jsonl and prints it; the time it takes is
            not training time."""
            nonlocal samples_since_eval, seconds_at_eval, wall_at_eval, segment_start
            synchronize(self.device)
            self.train_seconds += time.perf_counter() - segment_start
            record = {**self._evaluate_and_record(loss_sum, samples_since_eval,
                                                  self.train_seconds - seconds_at_eval, wall_start),
                      "data_wait": round(data_wait.read()["data_share"], 4)}
            gpu_util = sampler.mean("util", since=wall_at_eval) if sampler is not None else None
            if gpu_util is not None:
                record["gpu_util"] = round(gpu_util, 1)
            wall_at_eval = record["wall"]
            if main:
                metrics.append(record)
            if scalars is not None:
                scalars.add(record, self.global_step)
            progress.log(_format_record(record, cfg.epochs, self.metric_tracker.metrics))
            loss_sum.zero_()
            samples_since_eval, seconds_at_eval = 0, self.train_seconds
            segment_start = time.perf_counter()
            return record

        try:
            segment_start = time.perf_counter()
            if self.epochs_done >= cfg.epochs and self.global_step > self.evaluated_at:
                evaluate_and_log()  # a resumed run whose last evaluation was interrupted: redo it
            while stopped_by is None and self.epochs_done < cfg.epochs:
                batches = self.train_loader.batches(self.epoch, start=self.batch_in_epoch) \
                    if first_batches is None else first_batches
                first_batches = None
                for batch in data_wait.timed(batches):
                    inputs, targets = self.task.split(batch)
                    count = leading_size(targets)
                    if self._example_inputs is None:
                        self._example_inputs = tree_map(lambda t: t[:1].clone(), inputs)
                    # the gradient all-reduce runs only on the micro-batch that ends an accumulation
                    stepping = (self.batch_in_epoch + 1) % cfg.grad_accum == 0 or \
                        self.batch_in_epoch + 1 == len(self.train_loader)
                    loss = self.step_graph.run(inputs, targets) if self.step_graph is not None else \
                        self.forward_backward(inputs, targets, cfg.grad_accum, sync=stepping)
                    if self.counts_metrics:
                        loss_sum += loss.float() * count
                        samples_since_eval += count
                    self.samples_seen += count * self.data_ranks
                    self.batch_in_epoch += 1

                    end_of_epoch = self.batch_in_epoch == len(self.train_loader)
                    if self.batch_in_epoch % cfg.grad_accum and not end_of_epoch:
                        continue  # accumulate more micro-batches before stepping
                    self.optimizer_step()
                    self.global_step += 1
                    progress.advance()
                    if profiler is not None:
                        profiler.step()
                    if end_of_epoch:
                        self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                    stepped_at = (self.epoch, self.batch_in_epoch, self.samples_seen)

                    elapsed = self.train_seconds + time.perf_counter() - segment_start
                    finished = self.epochs_done >= cfg.epochs  # epochs may end inside an epoch (e.g. 9.5)
                    if end_of_epoch and not finished:
                        # a streaming loader makes the next epoch's first batches while this one is
                        # evaluated and checkpointed, so that epoch does not start waiting for them
                        first_batches = self.train_loader.batches(self.epoch)
                    due_eval = (end_of_epoch if cfg.eval_every is None else self.global_step % cfg.eval_every == 0) \
                        or finished
                    # ranks must agree on stopping, so the clock of any one of them decides; that takes an
                    # all-reduce and a host sync, so several processes check every 16 steps, not every one
                    out_of_time = cfg.time_limit is not None and \
                        (not self.dist.active or self.global_step % 16 == 0) and \
                        self.dist.any(elapsed >= cfg.time_limit, self.device)
                    if due_eval or out_of_time:
                        if self._reached_target(evaluate_and_log()):
                            stopped_by = "target"
                    if out_of_time:
                        stopped_by = stopped_by or "time_limit"
                    due_checkpoint = finished or stopped_by is not None or \
                        (end_of_epoch and cfg.checkpoint_epochs and self.epoch % cfg.checkpoint_epochs == 0) or \
                        (cfg.checkpoint_every is not None and self.global_step % cfg.checkpoint_every == 0) or \
                        time.perf_counter() - last_checkpoint >= cfg.checkpoint_seconds
                    if due_checkpoint and (main or self.collective_state):  # every rank gives its part
                        # steps still queued on the GPU are training time; saving would wait for them
                        # inside the pause, which is not counted
                        synchronize(self.device)
                        pause = time.perf_counter()
                        self.save_checkpoint()
                        last_checkpoint = time.perf_counter()
                        segment_start += last_checkpoint - pause  # checkpoint time is not training time
                    if stopped_by is not None or end_of_epoch or finished:
                        break
            stopped_by = stopped_by or "epochs"
        except (KeyboardInterrupt, Stop):
            # batches consumed since the last optimizer step are not in the weights: redo them on resume
            self.epoch, self.batch_in_epoch, self.samples_seen = stepped_at
            self.optimizer.zero_grad(set_to_none=True)
            if main and not self.collective_state:  # (other ranks cannot be relied on to stop together)
                self.save_checkpoint()
            progress.close()
            if self.step_graph is not None:
                self.step_graph.release()
            raise KeyboardInterrupt(str(self.run_dir)) from None
        finally:
            if first_batches is not None and hasattr(first_batches, "close"):
                first_batches.close()  # started for an epoch that the run did not reach
            gc.unfreeze()
            self._unlock_run_dir()
            if previous_handler is not None:
                signal.signal(signal.SIGTERM, previous_handler)
            if sampler is not None:
                sampler.stop()
            if profiler is not None:
                profiler.close()
            if scalars is not None:
                scalars.close()
        progress.close()
        if self.step_graph is not None:  # before the process group goes; a later fit() captures again
            self.step_graph.release()
        wall_seconds = time.perf_counter() - wall_start
        self.phases.add("training", self.train_seconds - trained_before)
        self.phases.add("evaluations, checkpoints and logs during the loop",
                        wall_seconds - (self.train_seconds - trained_before))
        self.phases.restart()
        return self._finish(stopped_by, wall_seconds)

    @property
    def epochs_done(self) -> float:
        """Passes over the training set so far, counting the current one's batches."""
        return self.epoch + self.batch_in_epoch / len(self.train_loader)

    def forward_backward(self, inputs, targets, accumulate: int = 1, sync: bool = True) -> torch.Tensor:
        """One forward and backward pass; gradients of the loss / ``accumulate`` add up in ``.grad``.
        With several processes, ``sync=False`` keeps the gradients local (an accumulation step).
        Returns the (unscaled) loss, detached, on the device."""
        def step(inputs, targets):
            if self._cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with self.precision.autocast(self.device):
                loss = self.task.loss(call_model(self.forward, inputs), targets)
            self.scaler.scale(loss / accumulate if accumulate > 1 else loss).backward()
            return loss.detach()
        return self.strategy.forward_backward(step, inputs, targets, sync)

    def train_step(self, inputs, targets) -> torch.Tensor:
        """One optimizer step on one batch; returns the loss, on the device."""
        if self.step_graph is not None:
            loss = self.step_graph.run(inputs, targets)
        else:
            loss = self.forward_backward(inputs, targets)
        self.optimizer_step()
        return loss

    def optimizer_step(self) -> None:
        """Updates the weights from the gradients (a step graph has done that in its replay) and
        moves the learning-rate schedule on."""
        if self.step_graph is None:
            if self.config.grad_clip is not None:
                self.scaler.unscale_(self.optimizer)
                self.strategy.clip_gradients(self.config.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            if self.ema is not None:
                self.ema.update(self.model)
        self.scheduler.step()

    def _snapshot(self, state: dict) -> dict:
        """A copy of ``state`` to restore after the warm-up: beside the original while the GPU has
        twice its size free, else in host memory (a model of tens of gigabytes, e.g. DLRM's tables,
        would otherwise need its size again on the GPU)."""
        on_gpu = sum(t.numel() * t.element_size() for t in tree_flatten(state)[0]
                     if isinstance(t, torch.Tensor) and t.is_cuda)
        if on_gpu and torch.cuda.mem_get_info(self.device)[0] < 2 * on_gpu:
            return tree_map(lambda t: t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor)
                            else copy.deepcopy(t), state)
        return copy.deepcopy(state)

    def warm_up(self, evaluate: bool = True, batch=None) -> float:
        """Runs three training steps on ``batch`` (by default the first of epoch 0; with progressive
        resizing, three on its images at each size too) and
        (``evaluate``, unless evaluation runs eagerly) an evaluation, then puts every piece of state back, so that
        compilation and cuDNN autotuning happen before the clock starts. Returns the seconds
        it took."""
        start = time.perf_counter()
        saved = {"model": self._snapshot(self.model.state_dict()), "optimizer": self._snapshot(self.optimizer.state_dict()),
                 "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                 "ema": self._snapshot(self.ema.state_dict()) if self.ema else None,
                 "rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None}
        inputs, targets = self.task.split(batch if batch is not None else next(iter(self.train_loader.batches(0))))
        with self._compiling(inputs, targets):
            for inputs, targets in self._each_training_shape(inputs, targets):
                if self.step_graph is not None:
                    self.step_graph.warm(inputs, targets)
                else:
                    for _ in range(3):  # torch.compile records CUDA graphs on the third call
                        self.forward_backward(inputs, targets)
                        self.optimizer_step()
            # (--no-compile-eval: nothing to compile; cuDNN's first calls are left to the first evaluation)
            if evaluate and (self.config.compile_eval or not self.config.compile):
                self.evaluate(each_shape=True)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.scaler.load_state_dict(saved["scaler"])
        if self.ema:
            self.ema.load_state_dict(saved["ema"])
        torch.set_rng_state(saved["rng"])
        if saved["cuda_rng"] is not None:
            torch.cuda.set_rng_state_all(saved["cuda_rng"])
        if self.step_graph is not None:  # last: it records where the restored state lives
            self.step_graph.capture()
        synchronize(self.device)
        return time.perf_counter() - start

    def _each_training_shape(self, inputs, targets) -> list:
        """(inputs, targets) of each shape training will see: the first batch, and with
        progressive resizing its images at full size and at each size of the schedule."""
        batches = {batch_shapes(inputs): (inputs, targets)}
        if self.config.size_schedule and isinstance(self.dataset, ImageDataset):
            sizes = [tuple(self.dataset.train_images.shape[2:])]
            sizes += [(size, size) for size, _ in parse_size_schedule(self.config.size_schedule)]
            for size in sizes:
                resized = resize(inputs, size)
                batches.setdefault(batch_shapes(resized), (resized, targets))
        return list(batches.values())

    def _call(self, net, inputs) -> torch.Tensor:
        """One forward pass. Under CUDA graphs an output lives in memory the next replay
        overwrites, so outputs that are kept are cloned."""
        if not self._cuda_graphs:
            return call_model(net, inputs)
        torch.compiler.cudagraph_mark_step_begin()
        return tree_map(torch.clone, call_model(net, inputs))

    @property
    def _cuda_graphs(self) -> bool:
        return self._compile_mode == "reduce-overhead" and self.device.type == "cuda"

    @torch.no_grad()
    def evaluate(self, each_shape: bool = False) -> dict:
        """The loss and the task's metrics on the held-out split (one host synchronisation at
        the end), with the weight average when there is one: {"loss": ..., metric: ...}.

        ``each_shape`` (the warm-up's pass, whose metrics are thrown away): in a single process,
        only the batches of an input shape not yet seen twice, which is what compiling and
        recording CUDA graphs need; the rest of the held-out split would only cost time."""
        net = self.eval_forward
        was_training = self.model.training
        self.model.eval()
        tracker = self.metric_tracker
        seen: dict[tuple, int] = {}
        for batch in self.eval_loader.batches():
            inputs, targets = self.task.split(batch)
            if each_shape and not self.dist.active:
                shapes = tuple(tuple(t.shape) for t in tree_flatten(inputs)[0] if torch.is_tensor(t))
                seen[shapes] = seen.get(shapes, 0) + 1
                if seen[shapes] > 2:
                    continue
            with self.precision.autocast(self.device):
                outputs = self.task.eval_outputs(lambda x: self._call(net, x), inputs)
            if self.counts_metrics:  # (a pipeline stage before the last took part; the last has the outputs)
                tracker.update(outputs, targets)
        self.strategy.finish_evaluation(len(self.eval_loader), lambda: self._blank_pass(net))
        self.model.train(was_training)
        return tracker.compute(self.dist.all_reduce_sum)  # every rank has a shard

    def _blank_pass(self, net) -> None:
        """One evaluation forward pass on a blank sample (for strategies whose forward pass is a
        collective, on processes with fewer evaluation batches)."""
        with self.precision.autocast(self.device):
            self.task.eval_outputs(lambda x: self._call(net, x), tree_map(torch.zeros_like, self._example_inputs))

    def _evaluate_and_record(self, loss_sum, samples, seconds, wall_start) -> dict:
        totals = self.dist.all_reduce_sum(torch.stack([loss_sum.float(), torch.tensor(
            float(samples), device=loss_sum.device)]))  # over all processes
        samples = int(totals[1].item())
        train_loss = totals[0].item() / samples if samples else None  # (none after a resume's redone evaluation)
        if train_loss is not None and not math.isfinite(train_loss):
            raise GpuaccelError(f"the training loss is {train_loss} at step {self.global_step}: training diverged "
                                f"(no checkpoint of it was saved); try a lower --lr (this run: {self.config.lr:g}), "
                                f"--grad-clip, or --precision fp32")
        result = self.evaluate()
        self.last_eval, self.evaluated_at = result, self.global_step
        for name, value in result.items():
            better = max if self.task.higher_is_better(name) else min
            self.best_metrics[name] = better(self.best_metrics.get(name, value), value)
        if self.time_to_target is None and self._reached_target(result):
            self.time_to_target = self.train_seconds
        rate = round(samples / max(seconds, 1e-9), 1)
        return {"step": self.global_step, "epoch": round(self.epoch + self.batch_in_epoch / len(self.train_loader), 4),
                "train_loss": None if train_loss is None else round(train_loss, 6),
                **{name: round(value, 6) for name, value in result.items()},
                "lr": self.scheduler.get_last_lr()[0], "samples_per_second": rate,
                **({"tokens_per_second": round(rate * self.inputs.tokens_per_sample)}
                   if self.inputs.tokens_per_sample else {}),
                **({"images_per_second": rate} if self.dataset is not None else {}),
                "elapsed": round(self.train_seconds, 4), "wall": round(time.perf_counter() - wall_start, 4)}

    def _reached_target(self, result: dict) -> bool:
        if self.config.target_metric is None:
            return False
        metric, goal = self.config.target_metric
        value = result.get(metric)
        if value is None:
            return False
        return value >= goal if self.task.higher_is_better(metric) else value <= goal

    @property
    def best_accuracy(self) -> float:
        return self.best_metrics.get("accuracy", 0.0)

    # ------------------------------------------------------------------ run directory and checkpoints

    def _make_run_dir(self) -> Path:
        cfg = self.config
        if cfg.run_dir:
            path = Path(cfg.run_dir)
        else:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            model = cfg.model.replace(':', '_').replace('/', '_')
            path = Path("runs") / f"{self.inputs.name}-{model}-{stamp}"
            suffix = 1
            while path.exists():
                suffix += 1
                path = path.with_name(f"{path.name.split('~')[0]}~{suffix}")
        path.mkdir(parents=True, exist_ok=True)
        self._lock_run_dir(path)
        if (path / CHECKPOINT).exists():
            self._unlock_run_dir()
            raise GpuaccelError(f"{path} already holds a run; continue it with --resume {path} or pick another --run-dir")
        checkpoint.write_json(path / "config.json", cfg.to_dict())
        return path

    def _lock_run_dir(self, path: Path) -> None:
        """Only one process trains in a run directory at a time (rank 0 holds the lock for all);
        what a killed process left half-written there is removed."""
        if self.dist.is_main and self._lock is None:
            self._lock = RunLock(path).acquire()
            remove_stale_temporaries(path)

    def _unlock_run_dir(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _state(self, full: bool) -> dict:
        """What checkpoints hold. Sharded, this gathers the full state to rank 0: a collective."""
        model_state, optimizer_state = self.strategy.gather_state(self.optimizer if full else None)
        state = {"model_name": self.config.model, "model_args": self.model_args, "model_path": self.config.model_path,
                 "task": self.task.describe(), "classes": self.inputs.classes, "mean": self.mean, "std": self.std,
                 "tokenizer": self.inputs.tokenizer, "audio": self.inputs.audio, "ratings": self.inputs.ratings,
                 "data_identity": self.inputs.identity, "config": self.config.to_dict(), "model": model_state,
                 "ema_model": {k: v.detach().cpu() for k, v in self.ema.module.state_dict().items()} if self.ema else None,
                 "accuracy": self.last_eval.get("accuracy"), "metrics": self.last_eval, "gpuaccel": __version__,
                 "structure": self.structure}
        if full:
            state.update(
                optimizer=optimizer_state, scheduler=self.scheduler.state_dict(),
                scaler=self.scaler.state_dict(), ema=self.ema.state_dict() if self.ema else None,
                rng={"torch": torch.get_rng_state(),
                     "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                position={"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "global_step": self.global_step},
                progress={"train_seconds": self.train_seconds, "samples_seen": self.samples_seen,
                          "best_metrics": self.best_metrics, "time_to_target": self.time_to_target,
                          "last_eval": self.last_eval, "evaluated_at": self.evaluated_at})
        return state

    def save_checkpoint(self) -> Path:
        """Writes checkpoint.pt (rank 0; sharded and pipelined runs call this on every rank to gather)."""
        path = self.run_dir / CHECKPOINT
        state = self._state(full=True)
        if not self.dist.is_main:
            return path
        checkpoint.save(path, state)
        self._write_position()
        return path

    def _write_position(self) -> None:
        """checkpoint.json: a readable copy of where checkpoint.pt stands (checkpoint.pt is the
        truth; a kill between the two writes is mended when the run resumes)."""
        checkpoint.write_json(self.run_dir / "checkpoint.json",
                              {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                               "global_step": self.global_step})

    def load_state(self, state: dict) -> None:
        """Restores everything ``save_checkpoint`` wrote, so training continues where it stopped."""
        if state["model_name"] != self.config.model:
            raise GpuaccelError(f"the checkpoint was made for model {state['model_name']!r}, not {self.config.model!r}")
        try:
            self.strategy.load_state(self.optimizer, state["model"], state["optimizer"])
        except (RuntimeError, KeyError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0]
            raise GpuaccelError(f"the checkpoint does not fit model {self.config.model!r}: {first}") from None
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and state.get("ema"):
            self.ema.load_state_dict(state["ema"])
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"][:torch.cuda.device_count()])
        pos, prog = state["position"], state["progress"]
        self.epoch, self.batch_in_epoch, self.global_step = pos["epoch"], pos["batch_in_epoch"], pos["global_step"]
        self.train_seconds, self.samples_seen = prog["train_seconds"], prog["samples_seen"]
        self.best_metrics, self.time_to_target = prog["best_metrics"], prog["time_to_target"]
        self.last_eval, self.evaluated_at = prog["last_eval"], prog.get("evaluated_at", self.global_step)

    # settings a resumed run may change: where and how it runs, when it stops, what it logs
    RESUME_CHANGEABLE = frozenset({
        "epochs", "time_limit", "target", "target_acc", "device", "loader", "workers", "monitor", "profile",
        "tensorboard", "eval_every", "checkpoint_every", "checkpoint_seconds", "checkpoint_epochs", "cache_dir",
        "compile", "activation_checkpointing"})

    @classmethod
    def resume(cls, run_dir, *, overrides: dict | None = None, quiet: bool = False, model: nn.Module | None = None,
               train_data=None, eval_data=None, task=None, loss_fn=None, metrics=None) -> "Trainer":
        """Rebuilds the trainer of ``run_dir`` from its config.json and continues from its checkpoint.

        ``overrides`` may change the stop conditions, the device and output settings; the
        model and data must stay those of the run. A run made from Python objects (a model,
        a Dataset, a loss function) needs the same objects again, passed as to ``Trainer``.
        """
        run_dir = Path(run_dir)
        if not run_dir.is_dir():
            raise GpuaccelError(f"resume directory {run_dir} does not exist")
        if not (run_dir / CHECKPOINT).exists() or not (run_dir / "config.json").exists():
            raise GpuaccelError(f"{run_dir} holds no gpuaccel checkpoint to resume ({CHECKPOINT} and config.json)")
        lock = RunLock(run_dir).acquire() if Distributed.from_env().is_main else None
        try:
            config = TrainConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
            state = checkpoint.load(run_dir / CHECKPOINT)
            overrides = dict(overrides or {})
            if overrides.get("target_acc") is not None:  # the older spelling of --target
                overrides["target"], overrides["target_acc"] = f"accuracy={overrides['target_acc']:g}", None
            if "data" in overrides and resolved_spec(overrides["data"]) == config.data:
                overrides["data"] = config.data  # the same data, spelled another way
            for key, value in overrides.items():
                if key == "model" and value != state["model_name"]:
                    raise GpuaccelError(f"{run_dir} holds a checkpoint of model {state['model_name']!r}, "
                                        f"not {value!r}; resume without --model or start a new run")
                if getattr(config, key) != value and key not in cls.RESUME_CHANGEABLE:
                    raise GpuaccelError(f"--{key.replace('_', '-')} cannot change when resuming "
                                        f"(changeable: {', '.join(sorted(cls.RESUME_CHANGEABLE))})")
            changed = {k: (getattr(config, k), v) for k, v in overrides.items()
                       if k in cls.RESUME_CHANGEABLE and getattr(config, k) != v}
            config = config.replace(**{k: v for k, v in overrides.items() if k in cls.RESUME_CHANGEABLE})
            if model is not None and not config.model.startswith("object:"):
                raise GpuaccelError(f"{run_dir} trained model {config.model!r}, which it rebuilds itself; resume "
                                    f"without model=")
            trainer = cls(config, model=model, train_data=train_data, eval_data=eval_data, task=task,
                          loss_fn=loss_fn, metrics=metrics, structure=state.get("structure"), data_init=False,
                          quiet=quiet)
            trainer.inputs.check_same(state.get("data_identity"), run_dir)
            trainer.load_state(state)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        trainer.run_dir, trainer._lock, trainer.resumed = run_dir, lock, True
        if trainer.dist.is_main:
            if changed:  # config.json says what the rest of the run uses; the change is said once
                checkpoint.write_json(run_dir / "config.json", trainer.config.to_dict())
                if not quiet:
                    print("gpuaccel: resuming with " + ", ".join(
                        f"--{k.replace('_', '-')} {new} (was {old})" for k, (old, new) in changed.items()) +
                        ("; the learning-rate schedule is re-planned for the new length" if "epochs" in changed
                         else "") + "; config.json updated", file=sys.stderr)
            remove_stale_temporaries(run_dir)
            trainer._write_position()
            # evaluations logged after the checkpoint are redone, and a line torn by a crash goes:
            # the log stays one line per evaluation
            MetricsFile(run_dir / "metrics.jsonl").repair(keep=lambda r: r.get("step", 0) <= trainer.global_step)
        return trainer

    def _finish(self, stopped_by: str, wall_seconds: float) -> dict:
        if self.dist.is_main or self.collective_state:
            state = self._state(full=False)
            if self.dist.is_main:
                checkpoint.save(self.run_dir / FINAL_MODEL, state)
        self.phases.mark("writing model.pt")
        rate = round(self.samples_seen / self.train_seconds if self.train_seconds > 0 else 0.0, 1)
        target = self.config.target_metric
        images = self.dataset is not None
        summary = {
            "device": str(self.device), "device_name": device_name(self.device), "precision": self.precision.name,
            "channels_last": self.channels_last, "compile": self.config.compile,
            "step_graph": self.step_graph is not None, "step_graph_off": self.step_graph_off,
            "model": self.config.model, "parameters": self.parameter_count, "task": self.task.name,
            "data": self.inputs.name, "train_samples": self.inputs.train_samples,
            "test_samples": self.inputs.test_samples, "skipped_samples": self.inputs.skipped,
            "epochs": round(self.epochs_done, 4), "steps": self.global_step,
            "stopped_by": stopped_by, "resumed": self.resumed, "setup_seconds": round(self.setup_seconds, 3),
            "warmup_seconds": round(self.warmup_seconds, 3),
            "wall_seconds": round(wall_seconds, 3), "train_seconds": round(self.train_seconds, 3),
            "samples_per_second": rate, "sample_unit": self.inputs.unit,
            "tokens_per_second": round(rate * self.inputs.tokens_per_sample) if self.inputs.tokens_per_sample else None,
            "main_metric": self.task.default_target,
            "metrics": dict(self.last_eval), "best_metrics": dict(self.best_metrics),
            "target": self.config.target, "target_metric": target[0] if target else None,
            "time_to_target": None if self.time_to_target is None else round(self.time_to_target, 3),
            "test_loss": self.last_eval.get("loss"),
            "run_dir": str(self.run_dir), "torch": torch.__version__, "gpuaccel": __version__,
            "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
            if self.device.type == "cuda" else None,
            "jpeg_decoder": self.jpeg_decoder,
            "processes": self.dist.world_size, "global_batch_size": self.config.batch_size * self.data_ranks *
            self.config.grad_accum, "samples_seen": self.samples_seen, "restarts": self.dist.restart,
            "phases": self.phases.table(),  # this process's wall-clock time, phase by phase, until now
        }
        if "accuracy" in self.last_eval or "accuracy" in self.best_metrics:
            summary.update(test_accuracy=self.last_eval.get("accuracy"), best_accuracy=self.best_accuracy)
        if images:  # the names image tools and earlier results use
            summary.update(train_images=summary["train_samples"], test_images=summary["test_samples"],
                           skipped_images=summary["skipped_samples"], images_per_second=rate,
                           images_seen=self.samples_seen)
        if self.dist.is_main:
            checkpoint.write_json(self.run_dir / "summary.json", summary)
        self.dist.barrier()  # nobody leaves (and tears the group down) before rank 0 has written
        return summary


def _resolve_task(config: TrainConfig, inputs, task, loss_fn, metrics) -> Task:
    """The task object: given, built from ``loss_fn`` (and ``metrics``), named by the config,
    or the data's own; user ``metrics`` are added to a task's."""
    if task is not None and loss_fn is not None:
        raise GpuaccelError("pass task= or loss_fn= (with metrics=), not both")
    if loss_fn is not None:
        return CustomTask(loss_fn, metrics)
    if isinstance(task, str) or task is None:
        name = task or config.task or inputs.task
        if name is None:
            raise GpuaccelError("with train_data= from Python, say what to minimise: task= (e.g. "
                                "gpuaccel.tasks.Regression()) or loss_fn=")
        task = create_task(name, label_smoothing=config.label_smoothing, tta=config.tta)
    if not isinstance(task, Task):
        raise GpuaccelError(f"task= takes a gpuaccel.tasks.Task or a task name, not {type(task).__name__}")
    if type(task).loss is Task.loss:
        raise GpuaccelError(f"task {task.name!r} defines no loss; give it a loss() or pass loss_fn=")
    return task.with_metrics(metrics) if metrics else task


def whole_step_obstacle(config: TrainConfig, device: torch.device, precision) -> str | None:
    """None when the whole training step is captured as one CUDA graph (step_graph.py), else
    what prevents it. It needs --compile-mode reduce-overhead on a GPU and a step that is the
    same kernels every time, on one device's whole model."""
    if not (config.compile and config.compile_mode == "reduce-overhead") or device.type != "cuda":
        return "it needs --compile --compile-mode reduce-overhead on a GPU"
    obstacles = {"--no-step-graph": not config.step_graph, "--pipeline-stages": config.pipeline_stages > 1,
                 "--shard": config.shard, "--sync-bn": config.sync_bn, "--grad-accum": config.grad_accum > 1,
                 "fp16 loss scaling": precision.loss_scaling,
                 "--activation-checkpointing": config.activation_checkpointing}
    found = [name for name, present in obstacles.items() if present]
    return f"not with {', '.join(found)}" if found else None


def _format_record(record: dict, epochs: float, metric_names) -> str:
    shown = "".join(f", test {name} " + (f"{100 * record[name]:.2f}%" if name == "accuracy" else f"{record[name]:.4g}")
                    for name in metric_names if name in record)
    train = "n/a" if record["train_loss"] is None else f"{record['train_loss']:.4f}"
    rate = f"{record['images_per_second']:,.0f} img/s" if "images_per_second" in record \
        else f"{record['tokens_per_second']:,.0f} tokens/s" if "tokens_per_second" in record \
        else f"{record['samples_per_second']:,.0f} samples/s"
    return (f"epoch {record['epoch']:.2f}/{epochs:g} step {record['step']}: train loss {train}, "
            f"test loss {record['loss']:.4f}{shown}, {rate}, {record['elapsed']:.1f} s, "
            f"data wait {100 * record['data_wait']:.0f}%"
            + (f", GPU busy {record['gpu_util']:.0f}%" if "gpu_util" in record else ""))


def _install_sigterm():
    """SIGTERM (what torchrun and schedulers send) checkpoints and stops, like Ctrl-C."""
    def handler(signum, frame):
        raise Stop()
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        return None
