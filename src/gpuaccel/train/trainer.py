"""The training engine: one loop, read top to bottom in ``fit``.

A ``Trainer`` owns the model, the data loaders, the optimizer and the run directory.
Per step it does a forward pass under autocast, a backward pass (loss-scaled for
fp16), and every ``grad_accum`` micro-batches an optimizer and schedule step. Losses
and accuracies are accumulated on the device and read only at evaluations, so the
step never waits for the GPU. Evaluations, checkpoints and the stop conditions
(epochs, time limit, target accuracy) happen between optimizer steps.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import json
import math
import os
import signal
import time
from datetime import datetime
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import __version__
from ..compiling import compile_arguments
from ..data import ImageDataset, StreamingDataset, open_dataset
from ..data.augment import AugmentConfig
from ..data.loader import build_loader
from ..device import device_name, resolve_device, resolve_precision, synchronize
from ..errors import GpuaccelError
from ..models import create_model
from ..deploy.prune import apply_structure
from ..monitor import DataWaitMeter, GpuSampler
from ..monitor.profiling import ScalarLog, StepProfiler
from ..parallel import Distributed, apply_activation_checkpointing, apply_ddp, average_gradients, broadcast_state
from ..parallel.fsdp import apply_fsdp, full_state, load_full_state
from ..parallel.pipeline import Pipeline
from . import checkpoint
from .config import TrainConfig
from .ema import WeightAverage
from .optim import build_optimizer, build_scheduler
from .progress import MetricsFile, Progress
from .step_graph import StepGraph

CHECKPOINT = "checkpoint.pt"
FINAL_MODEL = "model.pt"


class Stop(Exception):
    """Raised by a signal handler so that SIGTERM stops training like Ctrl-C does."""


class Trainer:
    def __init__(self, config: TrainConfig, *, dataset: ImageDataset | None = None, model: nn.Module | None = None,
                 structure: dict | None = None, data_init: bool = True, quiet: bool = False):
        """``model``: train this instead of creating ``config.model`` (a pruned one, say: then
        ``structure`` holds its layer widths, stored in checkpoints so it can be rebuilt).
        ``data_init=False`` skips a model's data-dependent initialisation (it is trained already)."""
        setup_start = time.perf_counter()
        self.config = config = config.validate()
        self._compile_mode = config.compile_mode if config.compile else None
        self.quiet = quiet
        # one process, or one of several started by torchrun: then each takes its shard of the data
        self.dist = Distributed.from_env()
        self.device = self.dist.device(config.device) if self.dist.active else resolve_device(config.device)
        self.dist.init(self.device)
        self.precision = resolve_precision(config.precision, self.device)
        if dataset is None:
            if not self.dist.is_main:
                self.dist.barrier()  # rank 0 decodes and caches the data set; the others then read the cache
            dataset = open_dataset(config.data, stream=config.loader == "stream", val_split=config.val_split,
                                   image_size=config.image_size, skip_bad=config.skip_bad, seed=config.seed,
                                   cache_dir=config.cache_dir, decode_device=self.device)
            if self.dist.is_main:
                self.dist.barrier()
        self.dataset = dataset

        torch.manual_seed(config.seed)
        ds = self.dataset
        self.model_args = {"num_classes": ds.num_classes, "in_channels": ds.in_channels, "image_size": ds.image_size}
        self.structure = structure
        if model is None:
            model = create_model(config.model, **self.model_args)
            if structure:
                apply_structure(model, structure)
        if config.activation_checkpointing and config.pipeline_stages == 1:  # (a pipeline wraps its stage's blocks)
            apply_activation_checkpointing(model)
        self.model = model
        self.parameter_count = sum(p.numel() for p in model.parameters())
        has_conv = any(isinstance(m, nn.Conv2d) for m in self.model.modules())
        self.channels_last = (self.device.type == "cuda" and has_conv) if config.channels_last is None \
            else config.channels_last
        # FSDP shards contiguous parameters only; the inputs alone are then channels_last
        layout = torch.channels_last if self.channels_last and not config.shard else torch.preserve_format
        # a pipeline stage or FSDP with CPU offload puts the parameters where they belong, part by part
        self.on_host = config.pipeline_stages > 1 or config.offload == "cpu"
        self.model.to(torch.device("cpu") if self.on_host else self.device, memory_format=layout)
        if config.deterministic:
            # cuDNN's autotuner times its candidates, so which kernel wins, and its rounding, varies
            # from process to process; cuBLAS needs a fixed workspace before its first call
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        elif self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # shapes are fixed: let cuDNN pick its fastest kernels

        self.mean, self.std = ds.channel_stats()
        # the processes that read different data: all of them, or one per pipeline (its stages share a batch)
        self.data_rank = self.dist.rank // config.pipeline_stages
        self.data_ranks = max(1, self.dist.world_size // config.pipeline_stages)
        loader_args = dict(device=self.device, mean=self.mean, std=self.std, dtype=self.precision.input_dtype,
                           channels_last=self.channels_last, seed=config.seed, rank=self.data_rank,
                           world_size=self.data_ranks)
        if isinstance(ds, StreamingDataset):
            if config.crop_padding or config.cutout:
                raise GpuaccelError("--crop-padding and --cutout are for in-memory data; streamed images are "
                                    "random-resized crops with random flips")
            loader_args.update(skip_bad=config.skip_bad, workers=config.workers, cpu_decode=config.cpu_decode)
            self.train_loader = ds.loader(train=True, batch_size=config.batch_size, **loader_args)
            self.eval_loader = ds.loader(train=False, batch_size=config.eval_batch_size, **loader_args)
        else:
            loader_args.update(placement=config.loader, workers=config.workers)
            self.train_loader = build_loader(
                torch.from_numpy(ds.train_images), torch.from_numpy(ds.train_labels), batch_size=config.batch_size,
                train=True, augment=AugmentConfig(config.crop_padding, config.flip, config.cutout), **loader_args)
            self.eval_loader = build_loader(
                torch.from_numpy(ds.test_images), torch.from_numpy(ds.test_labels),
                batch_size=config.eval_batch_size, train=False, **loader_args)
        if data_init and hasattr(self.model, "data_init"):  # data-dependent initialisation, e.g. patch whitening
            sample = self.train_loader.normalised_sample(5000)
            self.model.data_init(sample.float().cpu() if self.on_host else sample)
        self.ddp = None
        self.pipeline = None
        self.sharded = config.shard
        if self.precision.loss_scaling and (self.sharded or config.pipeline_stages > 1):
            raise GpuaccelError("--shard and --pipeline-stages train in bf16 or fp32; fp16 loss scaling is not "
                                "supported with them (use --precision bf16 or fp32)")
        if self.sharded:  # parameters, gradients and optimizer state split across the processes
            self.model = apply_fsdp(self.model, self.device, offload=config.offload == "cpu")
        elif config.pipeline_stages > 1:  # this process keeps one stage of the model
            self.pipeline = Pipeline(
                self.model, stages=config.pipeline_stages, microbatches=config.pipeline_microbatches,
                schedule=config.pipeline_schedule, split_points=config.split_points, device=self.device,
                input_shape=(ds.in_channels, *self._input_size()), batch_size=config.batch_size,
                eval_batch_size=config.eval_batch_size, channels_last=self.channels_last,
                label_smoothing=config.label_smoothing, compile_mode=config.compile_mode if config.compile else None,
                activation_checkpointing=config.activation_checkpointing)
            self.model = self.pipeline.module
        # CUDA graphs: the whole step as one graph where it can be captured (see step_graph.py), else
        # torch.compile's graphs of the forward and backward passes
        whole_step = (self._compile_mode == "reduce-overhead" and config.step_graph and self.device.type == "cuda"
                      and self.pipeline is None and not self.sharded and not config.sync_bn
                      and config.grad_accum == 1 and not self.precision.loss_scaling and config.optimizer in ("sgd", "muon")
                      and not config.activation_checkpointing)
        if self.dist.active and whole_step:  # data parallel inside the graph: an all-reduce, no DDP hooks
            broadcast_state(self.model)
        elif self.dist.active and self.pipeline is None and not self.sharded:
            # training steps go through the wrapper; evaluation and saving use the model
            self.model, self.ddp = apply_ddp(self.model, self.device, bucket_cap_mb=config.ddp_bucket_mb,
                                             sync_batchnorm=config.sync_bn)
        # checkpoints of sharded and pipelined models are gathered from every process
        self.collective_state = self.sharded or self.pipeline is not None
        self.counts_metrics = self.pipeline is None or self.pipeline.is_last  # where losses are computed
        self.ema = WeightAverage(self.model, config.ema) if config.ema else None
        if whole_step:
            self._compile_mode = "default"  # inductor's kernels, captured by the step graph
        self.forward = self._compiled(self.ddp or self.model) if self.pipeline is None else None
        if self.pipeline is not None:
            self.eval_forward = self.pipeline.logits
        elif self.ema or self.ddp:
            self.eval_forward = self._compiled(self.ema.module if self.ema else self.model)
        else:
            self.eval_forward = self.forward

        self.steps_per_epoch = math.ceil(len(self.train_loader) / config.grad_accum)
        self.optimizer = build_optimizer(self.model, config, self.device, fused=not self.sharded)
        self.scheduler = build_scheduler(self.optimizer, config, self.steps_per_epoch)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision.loss_scaling)
        self.step_graph = StepGraph(
            self.model, self.forward, self.optimizer, label_smoothing=config.label_smoothing,
            autocast=lambda: self.precision.autocast(self.device, cache=False), grad_clip=config.grad_clip,
            ema=self.ema, reduce_gradients=average_gradients if self.dist.active else None) if whole_step else None

        # where in the data order training stands, and what it has achieved so far
        self.epoch = 0
        self.batch_in_epoch = 0
        self.global_step = 0
        self.train_seconds = 0.0
        self.images_seen = 0
        self.best_accuracy = 0.0
        self.last_eval: dict = {}
        self.time_to_target: float | None = None
        self.run_dir: Path | None = None
        self.warmup_seconds = 0.0
        self.setup_seconds = time.perf_counter() - setup_start

    def _compiled(self, module: nn.Module):
        if self._compile_mode is None:
            return module
        # compiled kernels are cached on disk, so only the first run on a machine pays for them
        from ..data.cache import default_cache_dir

        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_cache_dir().parent / "inductor"))
        # Static shapes: a short last evaluation batch gets a graph of its own rather than making
        # Dynamo recompile the model for a symbolic batch size (CUDA graphs record fixed shapes).
        return torch.compile(module, dynamic=False, **compile_arguments(self._compile_mode))

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
        metrics = MetricsFile(self.run_dir / "metrics.jsonl")
        progress = Progress(math.ceil(cfg.epochs * self.steps_per_epoch), self.global_step, self.quiet or not main)
        progress.log(f"{self.dataset.describe()}; model {cfg.model} "
                     f"({self.parameter_count:,} parameters) on "
                     f"{device_name(self.device)} [{self.device}], {self.precision.name}; run dir {self.run_dir}"
                     + (f"; {self.dist.world_size} processes, {self.config.batch_size} images each per step"
                        if self.dist.active and self.pipeline is None else "")
                     + (f"; {self.pipeline.describe()}" if self.pipeline is not None else "")
                     + ("; each training step one CUDA graph" if self.step_graph is not None else "")
                     + (f"; JPEG decoding: {self.jpeg_decoder}" if self.jpeg_decoder else ""))

        # (a pipeline's first steps also infer the shapes that pass between stages)
        first_batches = None  # the first epoch's, started before the warm-up: a streaming loader fills meanwhile
        if self.config.compile or self.device.type == "cuda" or self.pipeline is not None:
            first_batches = iter(self.train_loader.batches(self.epoch, start=self.batch_in_epoch))
            first = next(first_batches, None)
            if first is not None:
                first_batches = itertools.chain([first], first_batches)
            self.warmup_seconds = self.warm_up(batch=first)
            progress.log(f"warm-up (compilation, cuDNN autotuning) took {self.warmup_seconds:.1f} s; "
                         f"not counted as training time")
        loss_sum = torch.zeros((), device=self.device)  # summed on the device, read at evaluations
        images_since_eval, seconds_at_eval = 0, self.train_seconds
        last_checkpoint = time.perf_counter()
        stopped_by = None
        wall_start = time.perf_counter()
        previous_handler = _install_sigterm()
        self.model.train()
        stepped_at = (self.epoch, self.batch_in_epoch, self.images_seen)  # the position the weights correspond to
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
        # skipped (as long-running servers do); the garbage made before is collected first. A
        # caller that froze objects itself keeps them frozen, and this step is left to it.
        freezing = gc.get_freeze_count() == 0
        if freezing:
            gc.collect()
            gc.freeze()
        try:
            segment_start = time.perf_counter()
            while stopped_by is None and self.epochs_done < cfg.epochs:
                batches = self.train_loader.batches(self.epoch, start=self.batch_in_epoch) \
                    if first_batches is None else first_batches
                first_batches = None
                for images, labels in data_wait.timed(batches):
                    # the gradient all-reduce runs only on the micro-batch that ends an accumulation
                    stepping = (self.batch_in_epoch + 1) % cfg.grad_accum == 0 or \
                        self.batch_in_epoch + 1 == len(self.train_loader)
                    loss = self.step_graph.run(images, labels) if self.step_graph is not None else \
                        self.forward_backward(images, labels, cfg.grad_accum, sync=stepping)
                    if self.counts_metrics:
                        loss_sum += loss.float() * labels.shape[0]
                        images_since_eval += labels.shape[0]
                    self.images_seen += labels.shape[0] * self.data_ranks
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
                    stepped_at = (self.epoch, self.batch_in_epoch, self.images_seen)

                    elapsed = self.train_seconds + time.perf_counter() - segment_start
                    finished = self.epochs_done >= cfg.epochs  # epochs may end inside an epoch (e.g. 9.5)
                    due_eval = (end_of_epoch if cfg.eval_every is None else self.global_step % cfg.eval_every == 0) \
                        or finished
                    # ranks must agree on stopping, so the clock of any one of them decides; that takes an
                    # all-reduce and a host sync, so several processes check every 16 steps, not every one
                    out_of_time = cfg.time_limit is not None and \
                        (not self.dist.active or self.global_step % 16 == 0) and \
                        self.dist.any(elapsed >= cfg.time_limit, self.device)
                    if due_eval or out_of_time:
                        synchronize(self.device)
                        self.train_seconds += time.perf_counter() - segment_start
                        record = {**self._evaluate_and_record(loss_sum, images_since_eval,
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
                        progress.log(_format_record(record, cfg.epochs))
                        loss_sum.zero_()
                        images_since_eval, seconds_at_eval = 0, self.train_seconds
                        if cfg.target_acc is not None and record["accuracy"] >= cfg.target_acc:
                            stopped_by = "target_acc"
                        segment_start = time.perf_counter()
                    if out_of_time:
                        stopped_by = stopped_by or "time_limit"
                    due_checkpoint = end_of_epoch or finished or stopped_by is not None or \
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
            self.epoch, self.batch_in_epoch, self.images_seen = stepped_at
            self.optimizer.zero_grad(set_to_none=True)
            if main and not self.collective_state:  # (other ranks cannot be relied on to stop together)
                self.save_checkpoint()
            progress.close()
            if self.step_graph is not None:
                self.step_graph.release()
            raise KeyboardInterrupt(str(self.run_dir)) from None
        finally:
            if freezing:
                gc.unfreeze()
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
        return self._finish(stopped_by, time.perf_counter() - wall_start)

    @property
    def epochs_done(self) -> float:
        """Passes over the training set so far, counting the current one's batches."""
        return self.epoch + self.batch_in_epoch / len(self.train_loader)

    def forward_backward(self, images: torch.Tensor, labels: torch.Tensor, accumulate: int = 1,
                         sync: bool = True) -> torch.Tensor:
        """One forward and backward pass; gradients of the loss / ``accumulate`` add up in ``.grad``.
        With several processes, ``sync=False`` skips the gradient all-reduce (an accumulation step).
        Returns the (unscaled) loss, detached, on the device."""
        if self.pipeline is not None:  # micro-batches flow through the stages; accumulation is not allowed
            with self.precision.autocast(self.device):
                return self.pipeline.train_step(images, labels)
        if self._cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        if self.sharded:
            self.model.set_requires_gradient_sync(sync)
        local = self.ddp.no_sync() if (self.ddp is not None and not sync) else contextlib.nullcontext()
        with local:
            with self.precision.autocast(self.device):
                loss = F.cross_entropy(self.forward(images), labels, label_smoothing=self.config.label_smoothing)
            self.scaler.scale(loss / accumulate if accumulate > 1 else loss).backward()
        return loss.detach()

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One optimizer step on one batch; returns the loss, on the device."""
        if self.step_graph is not None:
            loss = self.step_graph.run(images, labels)
        else:
            loss = self.forward_backward(images, labels)
        self.optimizer_step()
        return loss

    def optimizer_step(self) -> None:
        """Updates the weights from the gradients (a step graph has done that in its replay) and
        moves the learning-rate schedule on."""
        if self.step_graph is None:
            if self.config.grad_clip is not None:
                self.scaler.unscale_(self.optimizer)
                if self.pipeline is not None:  # the norm of the whole model's gradient, over all stages
                    self.pipeline.clip_gradients(self.config.grad_clip)
                else:
                    nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            if self.ema is not None:
                self.ema.update(self.model)
        self.scheduler.step()

    def warm_up(self, evaluate: bool = True, batch: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
        """Runs three training steps on ``batch`` (by default the first of epoch 0) and
        (``evaluate``) a full evaluation, then puts every piece of state back, so that
        compilation and cuDNN autotuning happen before the clock starts. Returns the seconds
        it took."""
        start = time.perf_counter()
        saved = {"model": copy.deepcopy(self.model.state_dict()), "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                 "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                 "ema": copy.deepcopy(self.ema.state_dict()) if self.ema else None,
                 "rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None}
        images, labels = batch if batch is not None else next(iter(self.train_loader.batches(0)))
        if self.step_graph is not None:
            self.step_graph.warm(images, labels)
        else:
            for _ in range(3):  # torch.compile records CUDA graphs on the third call
                self.forward_backward(images, labels)
                self.optimizer_step()
        if evaluate:
            self.evaluate()
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

    def _tta_logits(self, net, images: torch.Tensor) -> torch.Tensor:
        """Mean logits over the image, its mirror (tta >= 1) and one-pixel translations of both
        (tta 2, half weight each)."""
        logits = self._call(net, images)
        if self.config.tta == 0:
            return logits
        flipped = images.flip(-1)
        logits = logits + self._call(net, flipped)
        if self.config.tta == 1:
            return logits / 2
        padded = [F.pad(x, (1, 1, 1, 1), mode="reflect") for x in (images, flipped)]
        h, w = images.shape[2:]
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        for x in padded:
            for dy, dx in ((0, 0), (2, 2)):
                # a contiguous copy has the strides of a normal batch: no recompilation
                shifted = x[:, :, dy:dy + h, dx:dx + w].contiguous(memory_format=layout)
                logits = logits + 0.5 * self._call(net, shifted)
        return logits / 4

    def _call(self, net, images: torch.Tensor) -> torch.Tensor:
        """One forward pass. Under CUDA graphs an output lives in memory the next replay
        overwrites, so outputs that are kept are cloned."""
        if not self._cuda_graphs:
            return net(images)
        torch.compiler.cudagraph_mark_step_begin()
        return net(images).clone()

    @property
    def _cuda_graphs(self) -> bool:
        return self._compile_mode == "reduce-overhead" and self.device.type == "cuda"

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss and top-1 accuracy on the held-out split (one host synchronisation at the end),
        with the weight average when there is one."""
        net = self.eval_forward
        was_training = self.model.training
        self.model.eval()
        correct = torch.zeros((), device=self.device, dtype=torch.long)
        loss_sum = torch.zeros((), device=self.device)
        for images, labels in self.eval_loader.batches():
            with self.precision.autocast(self.device):
                logits = self._tta_logits(net, images)
            if not self.counts_metrics:
                continue  # a pipeline stage before the last: it took part, the last stage has the logits
            loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum")
            correct += (logits.argmax(1) == labels).sum()
        if self.sharded and self.dist.active:
            self._match_forward_passes(net, len(self.eval_loader))
        self.model.train(was_training)
        totals = self.dist.all_reduce_sum(torch.stack([loss_sum, correct.float()]))  # every rank has a shard
        count = self.eval_loader.num_images
        return {"loss": totals[0].item() / count, "accuracy": totals[1].item() / count}

    def _match_forward_passes(self, net, batches: int) -> None:
        """A sharded model's forward pass is a collective: a rank whose evaluation shard has
        fewer batches runs as many more on a blank image as the longest shard has."""
        most = torch.tensor([float(batches)], device=self.device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        ds = self.dataset
        blank = torch.zeros(1, ds.in_channels, *self._input_size(), device=self.device,
                            dtype=self.precision.input_dtype)
        if self.channels_last:
            blank = blank.contiguous(memory_format=torch.channels_last)
        for _ in range(int(most.item()) - batches):
            with self.precision.autocast(self.device):
                self._tta_logits(net, blank)

    def _input_size(self) -> tuple[int, int]:
        ds = self.dataset
        if hasattr(ds, "test_images"):
            return tuple(ds.test_images.shape[2:])
        return (ds.image_size, ds.image_size)

    def _evaluate_and_record(self, loss_sum, images, seconds, wall_start) -> dict:
        totals = self.dist.all_reduce_sum(torch.stack([loss_sum.float(), torch.tensor(
            float(images), device=loss_sum.device)]))  # over all processes
        train_loss, images = totals[0].item() / max(1.0, totals[1].item()), int(totals[1].item())
        result = self.evaluate()
        self.last_eval = result
        self.best_accuracy = max(self.best_accuracy, result["accuracy"])
        target = self.config.target_acc
        if target is not None and self.time_to_target is None and result["accuracy"] >= target:
            self.time_to_target = self.train_seconds
        return {"step": self.global_step, "epoch": round(self.epoch + self.batch_in_epoch / len(self.train_loader), 4),
                "train_loss": round(train_loss, 6), "loss": round(result["loss"], 6),
                "accuracy": round(result["accuracy"], 6), "lr": self.scheduler.get_last_lr()[0],
                "images_per_second": round(images / max(seconds, 1e-9), 1),
                "elapsed": round(self.train_seconds, 4), "wall": round(time.perf_counter() - wall_start, 4)}

    # ------------------------------------------------------------------ run directory and checkpoints

    def _make_run_dir(self) -> Path:
        cfg = self.config
        if cfg.run_dir:
            path = Path(cfg.run_dir)
        else:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            path = Path("runs") / f"{self.dataset.name}-{cfg.model.replace(':', '_').replace('/', '_')}-{stamp}"
            suffix = 1
            while path.exists():
                suffix += 1
                path = path.with_name(f"{path.name.split('~')[0]}~{suffix}")
        if (path / CHECKPOINT).exists():
            raise GpuaccelError(f"{path} already holds a run; continue it with --resume {path} or pick another --run-dir")
        path.mkdir(parents=True, exist_ok=True)
        checkpoint.write_json(path / "config.json", cfg.to_dict())
        return path

    def _state(self, full: bool) -> dict:
        """What checkpoints hold. Sharded, this gathers the full state to rank 0: a collective."""
        if self.sharded:
            model_state, optimizer_state = full_state(self.model, self.optimizer if full else None)
        elif self.pipeline is not None:
            model_state, optimizer_state = self._gather_stages(full)
        else:
            model_state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
            optimizer_state = self.optimizer.state_dict() if full else None
        state = {"model_name": self.config.model, "model_args": self.model_args, "classes": self.dataset.classes,
                 "mean": self.mean, "std": self.std, "config": self.config.to_dict(),
                 "model": model_state,
                 "ema_model": {k: v.detach().cpu() for k, v in self.ema.module.state_dict().items()} if self.ema else None,
                 "accuracy": self.last_eval.get("accuracy"), "gpuaccel": __version__, "structure": self.structure}
        if full:
            state.update(
                optimizer=optimizer_state, scheduler=self.scheduler.state_dict(),
                scaler=self.scaler.state_dict(), ema=self.ema.state_dict() if self.ema else None,
                rng={"torch": torch.get_rng_state(),
                     "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                position={"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "global_step": self.global_step},
                progress={"train_seconds": self.train_seconds, "images_seen": self.images_seen,
                          "best_accuracy": self.best_accuracy, "time_to_target": self.time_to_target,
                          "last_eval": self.last_eval})
        return state

    def _gather_stages(self, full: bool):
        """The whole model's state (and each stage's optimizer state, as a list by stage) on rank 0;
        empty elsewhere. A collective."""
        from torch.utils._pytree import tree_map_only

        mine = tree_map_only(torch.Tensor, lambda t: t.detach().cpu(),
                             (self.model.state_dict(), self.optimizer.state_dict() if full else None))
        parts = self.pipeline.gather_to_first(mine)
        if parts is None:
            return {}, None
        model_state = {key: value for stage_state, _ in parts for key, value in stage_state.items()}
        return model_state, [optimizer_state for _, optimizer_state in parts] if full else None

    def save_checkpoint(self) -> Path:
        """Writes checkpoint.pt (rank 0; sharded and pipelined runs call this on every rank to gather)."""
        path = self.run_dir / CHECKPOINT
        state = self._state(full=True)
        if not self.dist.is_main:
            return path
        checkpoint.save(path, state)
        checkpoint.write_json(self.run_dir / "checkpoint.json",
                              {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                               "global_step": self.global_step})
        return path

    def load_state(self, state: dict) -> None:
        """Restores everything ``save_checkpoint`` wrote, so training continues where it stopped."""
        if state["model_name"] != self.config.model:
            raise GpuaccelError(f"the checkpoint was made for model {state['model_name']!r}, not {self.config.model!r}")
        try:
            if self.sharded:
                load_full_state(self.model, self.optimizer, state["model"], state["optimizer"])
            elif self.pipeline is not None:  # this stage's part
                self.model.load_state_dict({key: state["model"][key] for key in self.model.state_dict()})
                self.optimizer.load_state_dict(state["optimizer"][self.pipeline.stage_index])
            else:
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, KeyError) as exc:
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
        self.train_seconds, self.images_seen = prog["train_seconds"], prog["images_seen"]
        self.best_accuracy, self.time_to_target = prog["best_accuracy"], prog["time_to_target"]
        self.last_eval = prog["last_eval"]

    @classmethod
    def resume(cls, run_dir, *, overrides: dict | None = None, quiet: bool = False) -> "Trainer":
        """Rebuilds the trainer of ``run_dir`` from its config.json and continues from its checkpoint.

        ``overrides`` may change the stop conditions, the device and output settings; the
        model and data must stay those of the run.
        """
        run_dir = Path(run_dir)
        if not run_dir.is_dir():
            raise GpuaccelError(f"resume directory {run_dir} does not exist")
        if not (run_dir / CHECKPOINT).exists() or not (run_dir / "config.json").exists():
            raise GpuaccelError(f"{run_dir} holds no gpuaccel checkpoint to resume ({CHECKPOINT} and config.json)")
        with open(run_dir / "config.json") as f:
            config = TrainConfig.from_dict(json.load(f))
        state = checkpoint.load(run_dir / CHECKPOINT)
        changeable = {"epochs", "time_limit", "target_acc", "device", "loader", "workers", "monitor", "profile",
                      "tensorboard", "eval_every", "checkpoint_every",
                      "checkpoint_seconds", "cache_dir", "compile", "activation_checkpointing"}
        for key, value in (overrides or {}).items():
            if key == "model" and value != state["model_name"]:
                raise GpuaccelError(f"{run_dir} holds a checkpoint of model {state['model_name']!r}, "
                                    f"not {value!r}; resume without --model or start a new run")
            if getattr(config, key) != value and key not in changeable:
                raise GpuaccelError(f"--{key.replace('_', '-')} cannot change when resuming "
                                    f"(changeable: {', '.join(sorted(changeable))})")
        config = config.replace(**{k: v for k, v in (overrides or {}).items() if k in changeable})
        trainer = cls(config, structure=state.get("structure"), data_init=False, quiet=quiet)
        trainer.load_state(state)
        trainer.run_dir = run_dir
        # evaluations logged after the checkpoint are redone; drop them so the log stays one line per eval
        metrics = MetricsFile(run_dir / "metrics.jsonl")
        kept = [r for r in metrics.read() if r["step"] <= trainer.global_step]
        if trainer.dist.is_main:
            checkpoint.atomic_write(metrics.path, lambda f: f.write("".join(
                json.dumps(r) + "\n" for r in kept).encode()))
        return trainer

    def _finish(self, stopped_by: str, wall_seconds: float) -> dict:
        if self.dist.is_main or self.collective_state:
            state = self._state(full=False)
            if self.dist.is_main:
                checkpoint.save(self.run_dir / FINAL_MODEL, state)
        images_per_second = self.images_seen / self.train_seconds if self.train_seconds > 0 else 0.0
        summary = {
            "device": str(self.device), "device_name": device_name(self.device), "precision": self.precision.name,
            "channels_last": self.channels_last, "compile": self.config.compile,
            "step_graph": self.step_graph is not None,
            "model": self.config.model, "parameters": self.parameter_count,
            "data": self.dataset.name, "train_images": len(self.dataset.train_labels),
            "test_images": len(self.dataset.test_labels), "skipped_images": len(self.dataset.skipped),
            "epochs": round(self.epochs_done, 4), "steps": self.global_step,
            "stopped_by": stopped_by, "setup_seconds": round(self.setup_seconds, 3),
            "warmup_seconds": round(self.warmup_seconds, 3),
            "wall_seconds": round(wall_seconds, 3), "train_seconds": round(self.train_seconds, 3),
            "images_per_second": round(images_per_second, 1),
            "test_accuracy": self.last_eval.get("accuracy"), "test_loss": self.last_eval.get("loss"),
            "best_accuracy": self.best_accuracy, "target_acc": self.config.target_acc,
            "time_to_target": None if self.time_to_target is None else round(self.time_to_target, 3),
            "run_dir": str(self.run_dir), "torch": torch.__version__, "gpuaccel": __version__,
            "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
            if self.device.type == "cuda" else None,
            "jpeg_decoder": self.jpeg_decoder,
            "processes": self.dist.world_size, "global_batch_size": self.config.batch_size * self.data_ranks *
            self.config.grad_accum, "images_seen": self.images_seen, "restarts": self.dist.restart,
        }
        if self.dist.is_main:
            checkpoint.write_json(self.run_dir / "summary.json", summary)
        self.dist.barrier()  # nobody leaves (and tears the group down) before rank 0 has written
        return summary


def _format_record(record: dict, epochs: float) -> str:
    return (f"epoch {record['epoch']:.2f}/{epochs:g} step {record['step']}: train loss {record['train_loss']:.4f}, "
            f"test loss {record['loss']:.4f}, test acc {100 * record['accuracy']:.2f}%, "
            f"{record['images_per_second']:,.0f} img/s, {record['elapsed']:.1f} s, "
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
