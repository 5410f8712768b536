"""The training engine: a loop written on ``gpuaccel.Accelerator``, read top to bottom in ``fit`` (``_fit``).

A ``Trainer`` owns the model, the data loaders, the optimizer and the run; a task
(``gpuaccel.tasks``) owns what is specific to the problem: how a batch splits into inputs and
targets, the loss, the metrics and how evaluation runs the model. The accelerator places the
model (device, precision, layout, parallel strategy) and scales the loss; the runtime's
``CapturedStep`` runs the one training step, replayed as one CUDA graph where the settings
allow it and eagerly otherwise, the same code either way. Each step takes ``grad_accum``
micro-batches: forward passes under autocast, backward passes, the optimizer's update and
the weight average. Losses are summed on the device and read only at evaluations, so a step
never waits for the GPU. When to evaluate, checkpoint and stop is the ``Cadence``'s; the run's
files are its ``RunDirectory``'s; what a checkpoint holds is in ``checkpoint.py``, what a resume
may change in ``resume.py``; the warm-up before the clock starts in ``warmup.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from .. import __version__
from ..accelerator import Accelerator
from ..compiling import CompiledNote, allow_runtime_compiles, avoid_runtime_compiles, compile_module, \
    compile_regions, import_compiler
from ..data import resolved_spec
from ..data.stream import JpegBatches
from ..device import PinnedCopies, device_name, host_memory_bytes, synchronize
from ..errors import GpuaccelError
from ..models.registry import add_search_dir, builds_on_device, model_source_dir
from ..models.structure import apply_structure
from ..monitor.phases import SetupTimes
from ..parallel import Strategy, apply_activation_checkpointing
from ..runtime import CapturedStep, holds_whole_model, training_strategy
from ..tasks import MetricTracker, Task, resolve_task
from ..tasks.base import CustomTask, takes_labels, training_loss
from ..tasks.base import leading_size
from . import checkpoint
from .cadence import Cadence
from .config import DEFAULT_MODEL, SCHEMA, TrainConfig
from .ema import WeightAverage
from .inputs import USER_DATA, open_inputs
from .progress import Progress
from .resume import resume
from .run_dir import CHECKPOINT, RunDirectory
from .run_state import RunState
from .fit_context import TrainingClock, fit_context, signals_held, stop_readers
from . import evaluation
from .checks import check_processes_agree, check_task, create_for_data, whole_step_obstacle
from .summary import start_lines, summarise
from .warmup import training_shapes, warm_up


@dataclass(frozen=True)
class BuiltModel:
    """What a run keeps of the model it built: a pruned model's layer widths (``structure``,
    recorded so that a resume or export rebuilds it), its size, and whether it takes the labels
    and computes its own loss (HuggingFace's models; not when the user gave a loss function)."""

    structure: dict | None
    parameter_count: int
    takes_labels: bool


class Trainer:
    version = __version__

    def __init__(self, config: TrainConfig | None = None, *, model: nn.Module | None = None, train_data=None,
                 eval_data=None, task: Task | str | None = None, loss_fn=None, metrics: dict | None = None,
                 dataset=None, structure: dict | None = None, data_init: bool = True, quiet: bool = False,
                 strategy: Strategy | None = None):
        """``config``: the settings (``TrainConfig()``'s defaults when None).

        What to train on: ``config.data.source`` (a gpuaccel data spec), ``dataset`` (a data set a
        gpuaccel reader made), or ``train_data`` (and ``eval_data``): a map-style torch Dataset,
        a DataLoader, or a tuple/dict of tensors; without ``eval_data`` a ``val_split`` share is
        held out. What to train: ``config.model.name`` from the registry, or ``model`` (any
        nn.Module; with ``structure``, it is ``config.model.name`` reshaped to those layer widths,
        e.g. pruned). What to minimise: ``task`` (a ``gpuaccel.tasks`` object or name; image
        data default to classification) or ``loss_fn(outputs, targets)``, with ``metrics``
        ({name: torchmetrics metric or callable (outputs, targets) -> number}) reported at
        each evaluation. ``data_init=False`` skips a model's data-dependent initialisation.
        ``strategy``: a ``gpuaccel.parallel.Strategy`` instead of the one the settings imply."""
        setup_start = time.perf_counter()
        self.times = SetupTimes()  # the set-up's and the warm-up's seconds, part by part
        self.config = config = (config or TrainConfig()).replace().validate()  # (a copy: it records the run)
        self.quiet = quiet
        # the device, the process group under torchrun, the precision: the accelerator's
        self.acc = Accelerator(device=config.runtime.device, precision=config.runtime.precision,
                               channels_last=config.runtime.channels_last,
                               monitor=False)
        self.times.phases.mark("device (CUDA initialisation)")
        self._open_data(dataset, train_data, eval_data)
        self.task = resolve_task(task or config.model.task, loss_fn=loss_fn, metrics=metrics, default=self.inputs.task,
                                 label_smoothing=config.optimizer.label_smoothing, tta=config.loop.tta,
                                 num_classes=len(self.inputs.classes) if self.inputs.classes else None,
                                 **self.inputs.task_args)
        if config.loop.target_metric is not None:
            self.task.check_target(config.loop.target_metric[0])
        torch.manual_seed(config.loop.seed)
        self.model, self.built = self._build_model(model, structure)
        self.acc.fit_precision_to(self.model)  # (a model with recurrent layers takes no autocast under 'auto')
        check_processes_agree(self)
        self._place_model(strategy)
        self.compile_plan = self._first_compile_plan(
            standalone=all(x is None for x in (model, train_data, eval_data, dataset, structure, strategy, loss_fn,
                                               metrics)) and not isinstance(task, Task))
        if self.compile_plan == "deferred":  # (until it compiles, or the run ends)
            avoid_runtime_compiles()
        self.times.phases.mark("building and placing the model")
        self.acc.placement.configure_kernels(deterministic=config.runtime.deterministic,
                                             cudnn_benchmark=config.runtime.cudnn_benchmark)
        self._build_loaders(data_init)
        self.times.phases.mark("loaders (the data on the device, data-dependent initialisation)")
        if self._compile_mode is not None:
            import_compiler()
            self.times.phases.mark("importing torch.compile (Dynamo, Inductor)")
        self._wrap_model()
        self._make_forwards()
        self._build_step()
        # where in the data order training stands, and what it has achieved so far
        self.state = RunState()
        self.run: RunDirectory | None = None
        self.times.setup_seconds = time.perf_counter() - setup_start
        self.times.phases.mark("parallel strategy, optimizer, training step")

    # ------------------------------------------------------------------ what the parts below decided

    @property
    def dist(self):
        return self.acc.dist

    @property
    def device(self) -> torch.device:
        return self.acc.device

    @property
    def precision(self):
        """The accelerator's precision, fitted to the model (under 'auto' a recurrent model's)."""
        return self.acc.precision

    @property
    def scaler(self) -> torch.amp.GradScaler:
        return self.acc.scaler

    @property
    def channels_last(self) -> bool:
        return self.acc.layout == torch.channels_last

    @property
    def model_args(self) -> dict:
        """The arguments the model was created with (recorded: resuming, exporting and inference
        rebuild it from them)."""
        return {**self.inputs.model_args, **(self.config.model.model_args or {})}

    @property
    def parameter_count(self) -> int:
        return self.built.parameter_count

    @property
    def structure(self) -> dict | None:
        return self.built.structure

    @property
    def dataset(self):
        """A gpuaccel image data set, or None for other data."""
        return self.inputs.images

    @property
    def data_ranks(self) -> int:
        """How many processes read different batches (a pipeline's stages share theirs)."""
        return self.strategy.data_ranks

    @property
    def collective_state(self) -> bool:
        """Whether checkpoints are gathered from every process (FSDP, pipelines)."""
        return self.strategy.collective_state

    @property
    def batch_per_process(self) -> int:
        return self.config.loop.batch_per_process(self.data_ranks)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.train_loader) / self.config.optimizer.grad_accum)

    # ------------------------------------------------------------------ building

    def _open_data(self, dataset, train_data, eval_data) -> None:
        config = self.config
        if train_data is None and dataset is None:
            config.data.source = resolved_spec(config.data.source)  # recorded so that a resume works from anywhere
        self.inputs = open_inputs(config, dataset=dataset, train_data=train_data, eval_data=eval_data, dist=self.dist)
        if train_data is not None and self.inputs.images is None:
            config.data.source = USER_DATA
        if self.inputs.classes is not None and len(self.inputs.classes) < 2:
            raise GpuaccelError(f"{self.inputs.name} has one class ({self.inputs.classes[0]!r}); a classifier needs "
                                f"two or more to learn anything")
        self.times.phases.mark("reading the data")

    def _build_model(self, model: nn.Module | None, structure: dict | None) -> tuple[nn.Module, "BuiltModel"]:
        """The model to train, and how a run records it: a registry name or factory spec (rebuilt
        on resume, export and inference), or "object:Class" for a module passed in, which a
        resume must be given again."""
        config = self.config
        if model is None and config.model.name is None:  # none named: the data's own (images: DEFAULT_MODEL)
            config.model.name = self.inputs.default_model or \
                (DEFAULT_MODEL if config.data.source != USER_DATA else None)
        if model is None:
            if config.data.source == USER_DATA and ":" not in (config.model.name or ""):
                raise GpuaccelError("with train_data= from Python, pass the model too (model=...), or name a "
                                    "package.module:factory as the config's model")
            if config.model.name.startswith("object:"):
                raise GpuaccelError(f"this run trained a model passed as an object ({config.model.name[7:]}); pass "
                                    f"the same model again (model=...)")
            add_search_dir(config.model.model_path)
            # made on the GPU that trains it, where the model allows it (registry.builds_on_device)
            in_place = self.device.type == "cuda" and builds_on_device(config.model.name) and holds_whole_model(config)
            with torch.device(self.device) if in_place else contextlib.nullcontext():
                model = create_for_data(config.model.name, self.inputs, self.model_args,
                                        tuple(config.model.model_args or ()))
            if config.model.model_path is None:
                config.model.model_path = model_source_dir(config.model.name)
            if structure:
                apply_structure(model, structure)
        elif structure is None:  # (with a structure it is config.model.name, reshaped)
            if not isinstance(model, nn.Module):
                raise GpuaccelError(f"model= takes a torch.nn.Module, not {type(model).__name__}")
            config.model.name, config.model.model_path = f"object:{type(model).__qualname__}", None
        # (a pipeline wraps its stage's blocks itself)
        if config.model.activation_checkpointing and config.parallel.pipeline_stages == 1:
            apply_activation_checkpointing(model)
        if config.loop.batch_size == 1 and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            raise GpuaccelError(f"--batch-size 1 cannot train {config.model.name}: its batch norms need two or more "
                                f"samples per batch; use a larger --batch-size")
        # a model that takes labels gets the targets too, and its own loss is trained on
        # (HuggingFace's models), unless the user gave a loss_fn
        return model, BuiltModel(structure, sum(p.numel() for p in model.parameters()),
                                 takes_labels(model) and not isinstance(self.task, CustomTask))

    def _place_model(self, strategy: Strategy | None) -> None:
        """The whole-step CUDA graph's decision (said once, in the run's first line), the parallel
        strategy (one device, DDP, data parallel inside the step graph, FSDP or a pipeline stage;
        the loop never asks which), and the model moved where it trains, in its layout."""
        config, placement = self.config, self.acc.placement
        self.step_graph_off = whole_step_obstacle(config, self.device, self.precision)
        self.strategy = strategy or training_strategy(
            config, placement, captured_step=self.step_graph_off is None,
            channels_last=placement.channels_last(self.model, config.runtime.channels_last))
        self.acc.place_model(self.model, self.strategy)

    def _build_loaders(self, data_init: bool) -> None:
        config, inputs = self.config, self.inputs
        self.train_loader, self.eval_loader = inputs.loaders(
            config.replace(batch_size=self.batch_per_process), device=self.device,
            dtype=self.precision.input_dtype, channels_last=self.channels_last,
            rank=self.strategy.data_rank, world_size=self.data_ranks)
        if len(self.train_loader) == 0:
            raise GpuaccelError(f"{inputs.train_samples} training samples make no batch of "
                                f"{self.batch_per_process} per process")
        if data_init and hasattr(self.model, "data_init") and inputs.init_sample is not None:
            sample = inputs.init_sample(self.train_loader)  # for a data-dependent initialisation
            if sample is not None:
                self.model.data_init(*(t.cpu() if self.strategy.places_parameters else t for t in sample))

    def _wrap_model(self) -> None:
        """The strategy applied to the model; the weight average; the (compiled) forward passes of
        training and evaluation."""
        self._example_inputs = None  # one sample's inputs (set at the first step): blanks for sharded evaluation
        self.acc.prepare_model(self.model, strategy=self.strategy, loss_fn=self.task.loss,
                               first_inputs=lambda: self.task.split(next(iter(self.train_loader.batches(0))))[0])
        if self.config.optimizer.ema and getattr(self.strategy, "tables_sharded", False):
            raise GpuaccelError("--ema cannot average embedding tables sharded across processes (each holds "
                                "some of them); leave out --ema, or train in one process")
        self.ema = WeightAverage(self.model, self.config.optimizer.ema, self.device) \
            if self.config.optimizer.ema else None

    def _make_forwards(self) -> None:
        """The forward passes of training and evaluation, and the loss: compiled in the run's mode
        (``_compile_mode``), or as they are."""
        self.forward = self.strategy.training_forward(self._compiled)
        self.loss_fn = self._compiled(self.task.loss) if self.task.compile_loss else self.task.loss
        compile_for_eval = self._compiled if self.config.runtime.compile_eval else (lambda module, **_: module)
        forward_for_eval = self.forward if self.config.runtime.compile_eval else \
            self.strategy.training_forward(compile_for_eval)
        self.eval_forward = self.strategy.eval_forward(compile_for_eval, forward_for_eval,
                                                       self.ema.module if self.ema else None)

    def _build_step(self) -> None:
        """The optimizer and its schedule, and the training step: captured as one CUDA graph where
        ``step_graph_off`` is None, else run eagerly; the same code either way."""
        config = self.config
        self.optimizer, self.scheduler = config.optimizer.build_with_schedule(self.model, config.loop.epochs,
                                                                              self.steps_per_epoch)
        # its kernels (fused, capturable; sharded parameters) the accelerator's, as for a user's
        # optimizer (none of which changes a learning rate); under fp16 it is stepped through the
        # loss scaler
        self.stepper = self.acc.prepare_optimizer(self.optimizer)
        self.step = CapturedStep(self._train_step, [self.optimizer], self.device, max_shapes=16,
                                 uncaptured=self.step_graph_off)
        self.metric_tracker = MetricTracker(self.task, self.device)

    def _first_compile_plan(self, standalone: bool) -> str | None:
        """How the model compiles, as far as known before the warm-up: None (it does not), "now"
        (in this process, before training), or "deferred": uncompiled until the warm-up finds
        whether this machine compiled the same graphs before (``compile_now``) or a process in the
        background will, for the runs after this one (warmup.py). Deferring needs a run the
        settings alone describe (that process rebuilds it from them), one process, and the whole
        step as one CUDA graph (so that the uncompiled step is one launch, too); not with
        --deterministic (the result would depend on the cache) nor --compile-regions (compiled in
        place)."""
        runtime = self.config.runtime
        if not runtime.compile:
            return None
        deferrable = runtime.compile_background and standalone and self.step_graph_off is None and \
            not self.dist.active and not runtime.deterministic and not runtime.compile_regions
        return "deferred" if deferrable else "now"

    def compiled_note(self, inputs, targets) -> CompiledNote | None:
        """Whether this machine compiled this run's graphs before (gpuaccel.compiling): what
        identifies them is the configuration (less the seed, where the run writes and whether it
        may compile in the background), the model, its first batch's shapes and the device. None
        when the model does not compile."""
        if self.compile_plan is None:
            return None
        config = {name: value for name, value in self.config.flat().items()
                  if name not in ("seed", "compile_background") and SCHEMA[name].section != "logging"}
        shapes = [(tuple(t.shape), str(t.dtype)) for t in tree_flatten((inputs, targets))[0] if torch.is_tensor(t)]
        return CompiledNote([config, repr(self.model), shapes, device_name(self.device)])

    def compile_now(self) -> None:
        """A deferred compile made in this process after all (its graphs were compiled before, or
        training uncompiled would take long): the forward passes and the loss compiled."""
        self.compile_plan = "now"
        allow_runtime_compiles()
        import_compiler()
        self._make_forwards()

    def train_uncompiled(self) -> None:
        """A deferred compile left to a background process (warmup.py): this run trains uncompiled."""
        self.compile_plan = "background"

    def _compiled(self, module, split_bytes: int | None = None):
        """``module`` (or a function) compiled in the run's mode (``split_bytes``: see
        ``compile_module``); as it is without ``compile``."""
        if self._compile_mode is None:
            return module
        runtime = self.config.runtime
        if runtime.compile_regions and isinstance(module, nn.Module) and split_bytes is None and \
                compile_regions(module, self._compile_mode, runtime.tune_kernels):
            return module
        return compile_module(module, self._compile_mode, runtime.tune_kernels, split_bytes=split_bytes,
                              dynamic=self.inputs.shapes_vary)

    @property
    def _compile_mode(self) -> str | None:
        """torch.compile's mode for the model, None without compiling. The step graph records
        inductor's kernels itself (mode default): torch.compile's own CUDA graphs (mode
        reduce-overhead) inside it would be graphs within a graph."""
        runtime = self.config.runtime
        if self.compile_plan != "now":
            return None
        return "default" if self.step_graph_off is None else runtime.compile_mode

    @property
    def jpeg_decoder(self) -> str | None:
        """How a streaming loader decodes (e.g. "nvjpeg (direct), 0% pillow"); None for other loaders."""
        made = getattr(self.train_loader, "transform", None)  # (a user's BatchSource has none)
        return made.decoder if isinstance(made, JpegBatches) else None

    @property
    def run_dir(self) -> Path | None:
        return self.run.path if self.run is not None else None

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict:
        """Trains until a stop condition; returns the summary (also written to summary.json)."""
        try:
            return self._fit()
        finally:
            allow_runtime_compiles()  # (prebuilt kernels while the run might train uncompiled: not after it)

    def _fit(self) -> dict:
        cfg, main = self.config, self.dist.is_main
        self._open_run()
        progress = Progress(math.ceil(cfg.loop.epochs * self.steps_per_epoch), self.state.global_step,
                            self.quiet or not main)
        for line in start_lines(self):
            progress.log(line)
        try:
            next_batches = self.first_batches(progress)  # the first epoch's: checked, warmed up on, going
        except BaseException:  # (a check failed, Ctrl-C: the readers it started must not outlive it)
            stop_readers(self)
            self.run.unlock()
            raise
        cadence = Cadence(cfg, self.dist, self.device, collective_checkpoints=self.collective_state)
        clock = TrainingClock(self.state.train_seconds)
        stopped_by, checkpointing = None, 0.0  # (seconds spent writing checkpoints in the loop)
        self.times.phases.mark("run directory, first batch, task check")
        with fit_context(self, progress, clock) as context:
            if cfg.loop.time_limit is not None:  # (the time left says how long the run has, when that is less)
                progress.time_left = lambda: cfg.loop.time_limit - clock.training_seconds() - context.time_reserve()
            context.started(next_batches)
            if self.epochs_done >= cfg.loop.epochs and self.state.global_step > self.state.evaluated_at:
                context.evaluate_and_log()  # a resumed run whose last evaluation was interrupted: redo it
            while stopped_by is None and self.epochs_done < cfg.loop.epochs:
                batches = next_batches or self.train_loader.batches(self.state.epoch, start=self.state.batch_in_epoch)
                next_batches = None
                for micro_batches in self._optimizer_steps(self.acc.timed(batches)):
                    if self.ema is not None:
                        self.ema.advance_weight()  # (read by the step, captured or not)
                    loss = self.step(micro_batches)  # one CUDA graph's replay, or the same code eagerly
                    if self.strategy.counts_metrics:  # (a pipeline's last stage computes the losses)
                        clock.add(loss, sum(leading_size(targets) for _, targets in micro_batches))
                    self.scheduler.step()
                    end_of_epoch = self.state.stepped(len(micro_batches), self.data_ranks * sum(
                        leading_size(targets) for _, targets in micro_batches), len(self.train_loader))
                    context.stepped()
                    finished = self.epochs_done >= cfg.loop.epochs  # epochs may end inside an epoch (e.g. 9.5)
                    if end_of_epoch and not finished:
                        # a streaming loader makes the next epoch's first batches while this one is
                        # evaluated and checkpointed, so that epoch does not start waiting for them
                        next_batches = context.started(self.train_loader.batches(self.state.epoch))
                    # --time-limit covers the final evaluation too, and the step that would cross it
                    out_of_time = cadence.out_of_time(self.state.global_step,
                                                      clock.training_seconds() + context.time_reserve())
                    if cadence.evaluation_due(self.state.global_step, end_of_epoch, finished) or out_of_time:
                        if self._reached_target(context.evaluate_and_log()):
                            stopped_by = "target"
                    if out_of_time:
                        stopped_by = stopped_by or "time_limit"
                    last = finished or stopped_by is not None
                    if cadence.checkpoint_due(self.state.global_step, self.state.epoch, end_of_epoch, last) and \
                            (main or self.collective_state):  # every rank gives its part
                        # steps still queued on the GPU are training time; saving would wait for them
                        # inside the pause, which is not counted
                        synchronize(self.device)
                        self.state.train_seconds = clock.training_seconds()  # (what the checkpoint records)
                        with clock.paused():
                            saving = time.perf_counter()
                            self.save_checkpoint(last=last)
                            checkpointing += time.perf_counter() - saving
                        cadence.checkpointed()
                    if last or end_of_epoch:
                        break
            stopped_by = stopped_by or "epochs"
        self.step.release()  # before the process group goes; a later fit() records the step again
        self.times.phases.add("training", clock.trained)
        self.times.phases.add("evaluations and logs during the loop",
                              context.wall_seconds - clock.trained - checkpointing)
        self.times.phases.add("checkpoints during the loop", checkpointing)
        self.times.phases.restart()
        return self._finish(stopped_by, context.wall_seconds)

    def _optimizer_steps(self, batches):
        """The epoch's batches as optimizer steps, each a list of ``grad_accum`` (inputs, targets)
        micro-batches (the epoch's last takes what is left)."""
        group, left = [], len(self.train_loader) - self.state.batch_in_epoch
        for batch in batches:
            group.append(self.task.split(batch))
            if self._example_inputs is None:
                self._example_inputs = tree_map(lambda t: t[:1].clone(), group[-1][0])
            if len(group) == self.config.optimizer.grad_accum or len(group) == left:
                left -= len(group)
                yield group
                group = []

    def _train_step(self, micro_batches: list[tuple]) -> torch.Tensor:
        """One optimizer step: forward and backward passes on each micro-batch (the gradient
        all-reduce only on the last), the optimizer's update, the weight average. The same code
        runs eagerly and captured in a CUDA graph, so nothing in it reads a value on the host.
        Returns the sum over the micro-batches of loss x samples, on the device."""
        self.optimizer.zero_grad(set_to_none=True)  # (captured: the gradients are then allocated by the graph)
        total, last = None, len(micro_batches) - 1
        for k, (inputs, targets) in enumerate(micro_batches):
            loss = self.strategy.forward_backward(self._forward_backward(len(micro_batches)), inputs, targets,
                                                  sync=k == last)
            part = loss.float() * leading_size(targets)
            total = part if total is None else total + part
        if self.strategy.reduce_gradients is not None:  # data parallel inside the step graph
            self.strategy.reduce_gradients(self.model.parameters())
        if self.config.optimizer.grad_clip is not None:
            self.acc.clip_grad_norm_(self.model, self.config.optimizer.grad_clip)
        self.stepper.step()
        if self.ema is not None:
            self.ema.blend(self.model, self.ema.weight)
        return total

    def _forward_backward(self, accumulate: int):
        def forward_backward(inputs, targets) -> torch.Tensor:
            if self.torch_compile_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with self.acc.autocast():
                loss = training_loss(self.forward, inputs, targets, self.task, self.built.takes_labels,
                                     self.loss_fn)
            self.acc.backward(loss / accumulate if accumulate > 1 else loss)
            return loss.detach()
        return forward_backward

    def train_step(self, inputs, targets) -> torch.Tensor:
        """One optimizer step on one batch, and the schedule's; returns the loss, on the device."""
        if self.ema is not None:
            self.ema.advance_weight()
        loss = self.step([(inputs, targets)]) / leading_size(targets)
        self.scheduler.step()
        return loss

    def warm_up(self, evaluate: bool = True, batch=None) -> float:
        """Compiles, autotunes and records the step before the clock starts, then puts every piece
        of state back (warmup.py); returns the seconds it took (``times`` holds them, part by part)."""
        done = warm_up(self, evaluate, batch)
        self.times.warmup_seconds, self.times.warmup_phases = done.seconds, done.phases
        if done.setup_by_process is not None:
            self.times.setup_by_process = done.setup_by_process
        return done.seconds

    def _each_training_shape(self, inputs, targets) -> list:
        return training_shapes(self, inputs, targets)

    @property
    def epochs_done(self) -> float:
        """Passes over the training set so far, counting the current one's batches."""
        return self.state.epoch + self.state.batch_in_epoch / len(self.train_loader)

    # ------------------------------------------------------------------ around the loop

    def _open_run(self) -> None:
        """The run directory (made by rank 0 and named to the others), locked for this run."""
        if self.run is None:
            made, path = self.dist.on_main(lambda: RunDirectory.create(self.config.logging.run_dir, self.inputs.name,
                                                                       self.config.model.name, writer=True),
                                           share=lambda run: str(run.path))
            self.run = made or RunDirectory(Path(path), writer=False)
            self.run.write_config(self.config.to_dict())
        self.run.lock()  # (a resumed trainer holds it already)

    def first_batches(self, progress: Progress):
        """The batches of the epoch training starts in, already going (a streaming loader fills
        meanwhile), after the task has been checked on the first of them and, where anything
        needs it, the warm-up (compiling, autotuning, recording the step) ran on it."""
        batches = iter(self.train_loader.batches(self.state.epoch, start=self.state.batch_in_epoch))
        first = next(batches, None)
        if first is None:  # (a run resumed at an epoch's end)
            return None
        check_task(self, first)
        if self.config.runtime.compile or self.device.type == "cuda" or self.strategy.needs_warm_up:
            self.times.phases.mark("run directory, first batch, task check")
            self.warm_up(batch=first)
            self.times.phases.mark("warm-up (compiling, autotuning, graph capture, a first evaluation)")
            done = "compilation, cuDNN autotuning, graph capture" if self.device.type == "cuda" else "compilation"
            progress.log(f"warm-up ({done}) took {self.times.warmup_seconds:.1f} s; "
                         f"not counted as training time")
            if self.compile_plan == "background":
                progress.log("this machine has not compiled this model yet: this run trains uncompiled (each step "
                             "still one CUDA graph) while a background process compiles it for the runs after it "
                             "(--no-compile-background: wait for the compile instead)")
        return itertools.chain([first], batches)

    @property
    def torch_compile_graphs(self) -> bool:
        return self._compile_mode == "reduce-overhead" and self.device.type == "cuda"

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, each_shape: bool = False) -> dict:
        """The loss and the task's metrics on the held-out split (evaluation.py)."""
        return evaluation.evaluate(self, each_shape)

    def evaluate_and_record(self, loss_sum: torch.Tensor, samples: int, seconds: float, wall: float) -> dict:
        return evaluation.evaluate_and_record(self, loss_sum, samples, seconds, wall)

    def _reached_target(self, result: dict) -> bool:
        return evaluation.reached_target(self, result)

    @property
    def best_accuracy(self) -> float:
        return self.state.best_metrics.get("accuracy", 0.0)

    # ------------------------------------------------------------------ checkpoints and resuming

    def save_checkpoint(self, last: bool = False) -> Path:
        """Writes checkpoint.pt (rank 0; sharded and pipelined runs call this on every rank to gather),
        and best.pt where a better evaluation came since the last one, unless (``last``: the run's
        last checkpoint) model.pt is about to hold the same weights."""
        with signals_held():
            state = checkpoint.training_state(self, full=True)
            if state["shards"]:  # (every process writes its part, before checkpoint.pt names them)
                self.strategy.save_shards(self.run.path / state["shards"], self.optimizer)
            self.run.save_checkpoint(state, self.state.position())
            if not (last and self._last_evaluation_is_best()):
                self._save_best()
        return self.run.path / CHECKPOINT

    def keep_best(self) -> None:
        """The weights just evaluated are the best so far: a host copy of them (a collective where
        the state is gathered from every rank), written to best.pt at the next checkpoint."""
        if self.dist.is_main or self.collective_state:
            on_gpu = self._state_bytes_on_gpu()
            host = host_memory_bytes()
            if on_gpu is not None and (host is None or on_gpu <= host // 8):
                # into page-locked buffers made once (beyond an eighth of the host's memory they
                # would starve it): 0.008 s for GPT-2 small's 400 MB on an H200's host, where new
                # pageable memory took 0.25 s at every better evaluation (device.PinnedCopies)
                if self.state.best_copies is None:
                    self.state.best_copies = PinnedCopies(self.device)
                state = checkpoint.training_state(self, full=False, to_host=self.state.best_copies)
                self.state.best_copies.finish()
            else:
                state = checkpoint.training_state(self, full=False)
                if on_gpu is None:  # a gathered tensor may be the live one itself (a model on the CPU)
                    state = tree_map(lambda t: t.detach().to("cpu", copy=True) if torch.is_tensor(t) else t, state)
            self.state.best_weights = state
        self.state.best_step = self.state.global_step

    def _state_bytes_on_gpu(self) -> int | None:
        """The bytes of the model's state (and its weight average's) where it lies wholly on this
        process's GPU, not sharded nor pipelined (one GPU, or DDP): gathering it then copies each
        tensor to the host. None elsewhere."""
        if self.device.type != "cuda" or self.collective_state:
            return None
        modules = [self.model] + ([self.ema.module] if self.ema else [])
        tensors = [t for m in modules for t in m.state_dict().values()]
        if not all(torch.is_tensor(t) and t.is_cuda for t in tensors):
            return None
        return sum(t.nbytes for t in tensors)

    def _last_evaluation_is_best(self) -> bool:
        """Whether the weights now are the best evaluation's: model.pt then holds them, and best.pt is not written."""
        state = self.state
        return state.best_step is not None and state.best_step == state.evaluated_at == state.global_step

    def _save_best(self) -> None:
        if self.state.best_weights is not None:
            self.run.save_best(self.state.best_weights)
            self.state.best_weights = None

    def load_state(self, state: dict, folder: Path | None = None) -> None:
        """Restores everything ``save_checkpoint`` wrote, so training continues where it stopped
        (``folder``: the run directory the checkpoint is in, which holds a sharded run's shards)."""
        checkpoint.restore_training_state(self, state, folder)

    @classmethod
    def resume(cls, run_dir, *, overrides: dict | None = None, quiet: bool = False, model: nn.Module | None = None,
               train_data=None, eval_data=None, task=None, loss_fn=None, metrics=None) -> "Trainer":
        """Rebuilds the trainer of ``run_dir`` from its config.json and continues from its checkpoint.

        ``overrides`` may change the stop conditions, the device and output settings
        (``resume.RESUME_CHANGEABLE``); the model and data must stay those of the run. A run
        made from Python objects (a model, a Dataset, a loss function) needs the same objects
        again, passed as to ``Trainer``.
        """
        return resume(cls, run_dir, overrides=overrides, quiet=quiet, model=model, train_data=train_data,
                                 eval_data=eval_data, task=task, loss_fn=loss_fn, metrics=metrics)

    def continue_in(self, run: RunDirectory) -> None:
        """A resumed trainer takes over the run directory (locked) whose checkpoint it loaded."""
        self.run, self.state.resumed = run, True

    def _finish(self, stopped_by: str, wall_seconds: float) -> dict:
        last_is_best = self._last_evaluation_is_best()
        if self.dist.is_main or self.collective_state:
            # the best weights kept at the last evaluation are model.pt's state: not gathered again
            kept = self.state.best_weights if last_is_best else None
            self.run.save_model(kept if kept is not None else checkpoint.training_state(self, full=False))
        if last_is_best:
            self.state.best_weights = None  # the last weights are the best: model.pt is both
            self.run.remove_best()
        self._save_best()
        self.state.best_copies = None  # (their page-locked memory back to PyTorch's host allocator)
        self.times.phases.mark("writing model.pt")
        summary = summarise(self, stopped_by, wall_seconds)
        self.run.write_summary(summary)
        self.dist.barrier()  # nobody leaves (and tears the group down) before rank 0 has written
        return summary
