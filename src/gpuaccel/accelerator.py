"""``gpuaccel.Accelerator``: the runtime's public face, for a training loop the user keeps (HF
Accelerate's ``prepare``, Lightning Fabric's ``setup``). ``Trainer`` is a loop written on it.

    acc = gpuaccel.Accelerator()
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    for x, y in loader:                       # batches arrive on the device
        with acc.autocast():                  # the forward pass in the chosen precision
            loss = F.cross_entropy(model(x), y)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

Everything it does is ``gpuaccel.runtime``'s: the process group, device and precision
(``placement``), the parallel strategy (``strategy``), the device-resident and prefetching
loaders (``loaders``) and the whole step as CUDA graphs (``capture``). Under torchrun each
process joins the process group, trains its replica (or shard) and reads its shard of every
loader.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import time
import warnings
import weakref
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from .compiling import COMPILE_MODES, compile_module
from .data.source import is_batch_source
from .device import precision_name
from .errors import GpuaccelError, choice_error
from .monitor.gpu import GpuSampler
from .monitor.steps import DataWaitMeter
from .parallel import DataParallel, GraphDataParallel, PipelineParallel, Sharded, Strategy
from .parallel.fsdp import load_full_state, load_sharded, save_sharded
from .parallel.gradient_buckets import trainable_parameters
from .runtime import CapturedStep, Placement, choose_strategy, make_capturable, prepare_loader
from .runtime.capture import CapturedLoop, active_loop, capture_obstacle
from .runtime.loaders import SourceOnDevice
from .runtime.state import RNG, read_state, rng_state, set_rng_state, write_state
from .runtime.placement import ScaledOptimizer
from .runtime.strategy import STRATEGIES


class Accelerator:
    def __init__(self, device="auto", precision="auto", compile: bool = False, compile_mode: str = "default",
                 strategy: str | Strategy = "auto", channels_last: bool | None = None, monitor: bool = True):
        """``device``: auto (a CUDA GPU if there is one), cpu, cuda or cuda:N; ``precision``: auto
        (bf16 on GPUs that have it, fp16 with loss scaling on older ones, fp32 on the CPU; models
        with recurrent layers in tf32 on GPUs, fp32 on the CPU), or fp32, tf32 (fp32 with TF32
        matrix multiplies), bf16, fp16 in any spelling ('bfloat16', torch.bfloat16, 'half', ...);
        ``compile``: torch.compile the prepared models (``compile_mode``: torch.compile's mode);
        ``strategy``: with several processes, ddp (auto) or fsdp, or a ``gpuaccel.parallel``
        strategy object; ``channels_last``: NHWC for models with convolutions (default on GPUs);
        ``monitor``: sample the GPU's utilisation, memory and power in the background for
        :meth:`stats` (NVML)."""
        if not isinstance(strategy, Strategy) and strategy not in STRATEGIES:
            raise choice_error("strategy", strategy, STRATEGIES + ("or a gpuaccel.parallel.Strategy",))
        if compile_mode not in COMPILE_MODES:
            raise choice_error("compile mode", compile_mode, COMPILE_MODES)
        self.placement = Placement.resolve(device, precision)
        self._precision_chosen = precision_name(precision) == "auto"
        self.dist, self.device, self.precision = self.placement.dist, self.placement.device, self.placement.precision
        self.compile, self.compile_mode, self.channels_last = compile, compile_mode, channels_last
        self.strategy_name = strategy.name if isinstance(strategy, Strategy) else strategy
        self._given_strategy = strategy if isinstance(strategy, Strategy) else None
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision.loss_scaling)
        self._strategies: "weakref.WeakKeyDictionary[nn.Module, Strategy]" = weakref.WeakKeyDictionary()
        self._layout = torch.contiguous_format  # of image batches: channels_last once a model is
        self._optimizers: list[torch.optim.Optimizer] = []
        self._scaled: list[ScaledOptimizer] = []  # (fp16: the prepared optimizers, stepped through the scaler)
        # (weakly: a step the script no longer holds, say one defined anew each epoch, is freed with its graphs)
        self._captured_steps: weakref.WeakSet[CapturedStep] = weakref.WeakSet()
        self._captured_loops: dict[tuple, CapturedLoop] = {}  # by where the loop is written, and its items
        self._syncing = True  # False inside no_sync(): backward keeps the gradients local
        self._data_wait = DataWaitMeter(self.device)  # fed by the prepared loaders and timed()
        self._sampler: GpuSampler | None = None
        self._stats_since = 0.0
        if monitor:
            self.monitor()
        _latest["accelerator"] = weakref.ref(self)

    # ------------------------------------------------------------------ who this process is

    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world_size(self) -> int:
        return self.dist.world_size

    def print(self, *args, **kwargs) -> None:
        """``print`` on the main process only."""
        if self.is_main:
            print(*args, **kwargs)

    # ------------------------------------------------------------------ prepare

    def prepare(self, *objects, device_resident: bool | None = None):
        """Returns each object ready for this device and process, in the order given:

        - a model: moved, laid out (channels-last on a GPU when it has convolutions), wrapped by
          the parallel strategy, compiled with ``compile=True`` (a model compiled before is
          prepared inside its compiled wrapper and compiled alike); its forward pass runs in the
          chosen precision inside :meth:`autocast`;
        - an optimizer: its fused (or capturable) update on a GPU, so that a captured step can
          hold it; under fp16, ``step`` goes through the loss scaler;
        - a DataLoader: batches on the device, this process's shard, its attributes kept. Its
          data set lives on the device when that is safe (``device_resident``: True forces it,
          False never; see ``runtime.loaders.prepare_loader``), else batches are prefetched;
        - a :class:`~gpuaccel.BatchSource` of the script's own (``len()`` and ``batches(epoch,
          start)``): iterated like a DataLoader, each ``iter`` its next pass, its batches on the
          device and its waits timed (:meth:`stats`);
        - a learning-rate scheduler: as it is."""
        prepared = []
        for obj in objects:
            if isinstance(obj, nn.Module):
                self.fit_precision_to(obj)
                prepared.append(self.prepare_model(obj))
            elif isinstance(obj, torch.optim.Optimizer):
                prepared.append(self.prepare_optimizer(obj))
            elif isinstance(obj, DataLoader):
                prepared.append(self._prepare_loader(obj, device_resident))
            elif is_batch_source(obj):
                prepared.append(SourceOnDevice(obj, self.device, layout=self._layout, meter=self._data_wait))
            elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                prepared.append(obj)
            else:
                raise GpuaccelError(f"prepare() takes models, optimizers, DataLoaders, batch sources and "
                                    f"schedulers, not {type(obj).__name__}")
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def prepare_model(self, model: nn.Module, *, strategy: Strategy | None = None, **wrap_options) -> nn.Module:
        """:meth:`prepare` for one model, with more control: ``strategy`` (a parallel strategy object,
        instead of the accelerator's) and the strategy's ``wrap`` options. Returns what a training
        step calls."""
        wrapped = getattr(model, "_orig_mod", None)  # torch.compile's wrapper: prepare what it wraps, compile it alike
        if wrapped is not None:
            return _compiled_like(model, self.prepare_model(wrapped, strategy=strategy, **wrap_options),
                                  self.compile_mode)
        strategy = self.strategy_for(model, strategy)
        self.place_model(model, strategy)
        strategy.wrap(model, **wrap_options)
        return self._compile(strategy.training_module)

    def fit_precision_to(self, model: nn.Module) -> None:
        """Under precision 'auto', the precision for ``model``: no autocast if it has recurrent
        layers (:meth:`Placement.fitted_to`; :meth:`prepare` asks), unless an optimizer was already
        prepared for the precision chosen before."""
        if not self._precision_chosen or self._optimizers:
            return
        placement = self.placement.fitted_to(model)
        if placement is not self.placement:
            self.placement, self.precision = placement, placement.precision
            self.scaler = torch.amp.GradScaler(self.device.type, enabled=False)

    def strategy_for(self, model: nn.Module, strategy: Strategy | None = None) -> Strategy:
        """The parallel strategy ``model`` trains with (``strategy``, the accelerator's, or the one its
        settings choose), recorded for :meth:`no_sync`, :meth:`clip_grad_norm_` and :meth:`save`."""
        if model not in self._strategies:
            self._strategies[model] = strategy or self._given_strategy or \
                choose_strategy(self.placement, self.strategy_name)
        return self._strategies[model]

    def place_model(self, model: nn.Module, strategy: Strategy | None = None) -> bool:
        """Moves ``model`` to the device in its memory layout (channels-last on a GPU when it has
        convolutions, unless FSDP shards it; a strategy that places the parameters itself, such as
        pipeline stages or CPU offload, gets it on the host). Returns whether it is channels-last."""
        strategy = self.strategy_for(model, strategy)
        channels_last = self.placement.channels_last(model, self.channels_last)
        layout = torch.channels_last if channels_last and not isinstance(strategy, Sharded) else torch.preserve_format
        model.to(torch.device("cpu") if strategy.places_parameters else self.device, memory_format=layout)
        if channels_last:
            self._layout = torch.channels_last  # the loaders lay out image batches to match
        return channels_last

    @property
    def layout(self) -> torch.memory_format:
        """The memory layout of image batches for the prepared models: channels_last once a model
        is laid out so (the prepared loaders lay their batches out to match)."""
        return self._layout

    def _compile(self, module: nn.Module):
        return compile_module(module, self.compile_mode) if self.compile else module

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """:meth:`prepare` for one optimizer."""
        if self._shards():
            from torch.distributed.tensor import DTensor

            if any(not isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]):
                raise GpuaccelError("with strategy='fsdp', create the optimizer from the prepared model's "
                                    "parameters: model = acc.prepare(model), then optimizer, then "
                                    "acc.prepare(optimizer)")
            sharded = next((s for s in self._strategies.values() if isinstance(s, Sharded)), None)
            if self.device.type == "cuda" and sharded and sharded.fuses(type(optimizer).__name__.lower()) and \
                    not any(g.get("differentiable") for g in optimizer.param_groups):
                for group in optimizer.param_groups:  # (the fused kernel that Trainer's sharded AdamW takes)
                    group.update(fused=True, foreach=False)
        elif self.device.type == "cuda":
            make_capturable(optimizer)  # (fused where PyTorch has it: faster captured or not)
        self._optimizers.append(optimizer)
        if not self.scaler.is_enabled():
            return optimizer
        self._scaled.append(ScaledOptimizer(optimizer, self.scaler))
        return self._scaled[-1]

    def _prepare_loader(self, loader: DataLoader, device_resident: bool | None):
        def shared_seed() -> int:  # every process draws the same order to take disjoint shards of it
            return self.dist.broadcast(torch.initial_seed() % 2**31)

        return prepare_loader(loader, self.device, resident=device_resident, layout=self._layout,
                              meter=self._data_wait, rank=self.rank, world_size=self.world_size,
                              shared_seed=shared_seed)

    # ------------------------------------------------------------------ the step

    @contextlib.contextmanager
    def autocast(self):
        """The precision's autocast context: put the forward pass and the loss inside it. A loss
        PyTorch refuses to run under autocast (binary cross-entropy on probabilities) is one
        line saying what to use instead."""
        with self.precision.autocast(self.device):
            try:
                yield
            except RuntimeError as exc:
                if "unsafe to autocast" not in str(exc):
                    raise
                raise GpuaccelError(
                    f"F.binary_cross_entropy (nn.BCELoss) cannot run under acc.autocast() ({self.precision.name}: "
                    f"PyTorch refuses it, its log of a low-precision probability is unsafe); give the logits to "
                    f"F.binary_cross_entropy_with_logits (nn.BCEWithLogitsLoss), which autocast runs in float32, or "
                    f"compute the loss after the with-block on float32 probabilities: "
                    f"F.binary_cross_entropy(probs.float(), target)") from None

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled where fp16 needs it (and, in a captured step with several
        processes, the gradients averaged over them, unless inside :meth:`no_sync` or with the
        DDP wrapper's ``require_backward_grad_sync`` False)."""
        self.scaler.scale(loss).backward()
        if not self._syncing:
            return
        for strategy in self._strategies.values():
            if isinstance(strategy, GraphDataParallel) and strategy.averages_now():
                strategy.reduce_gradients(trainable_parameters(strategy.model))

    def capture(self, step_fn=None, *, warmup: int = 3, strict: bool = False):
        """``step_fn`` (forward, backward, optimizer step, all on the arguments it is given) as one
        CUDA graph, replayed: the first ``warmup`` calls run it as it is, the next records and
        replays it, every later call copies its tensor arguments in and replays (one launch for
        the whole step). Each new shape of the arguments is warmed up and recorded too (up to
        four; more run eagerly). Several micro-batches may be accumulated inside one step. With
        several processes the gradient all-reduce is recorded inside it (``acc.backward`` does
        it, in place of DDP's hooks: ``GraphDataParallel.from_ddp``). What the step returns is
        overwritten by the next call.

        Where a step cannot be captured (no GPU, fp16 loss scaling, FSDP, a host synchronisation
        such as ``.item()`` inside it, ...), it runs as it is, after one warning naming the cause
        (``strict=True``: a GpuaccelError instead). Also a decorator: ``@acc.capture`` or
        ``@acc.capture(warmup=5)``."""
        if step_fn is None:
            return functools.partial(self.capture, warmup=warmup, strict=strict)
        step = CapturedStep(step_fn, self._optimizers, self.device, warmup=warmup, strict=strict)
        obstacle = self._capture_obstacle()
        if obstacle is not None:
            if strict:
                raise GpuaccelError(f"capture(): {obstacle}")
            warnings.warn(f"capture(): {obstacle}: the step runs uncaptured", stacklevel=2)
            step.uncaptured = obstacle
            return step
        self._average_in_graphs()
        self._captured_steps.add(step)
        return step

    def captured(self, items, *, warmup: int = 3, strict: bool = False) -> CapturedLoop:
        """``for item in acc.captured(items):`` runs the loop's body over ``items`` as CUDA graphs,
        where it is written: a script's micro-step loop (``for micro_step in
        acc.captured(range(gradient_accumulation_steps)):``) is captured by changing its one line.
        The first ``warmup`` times the loop runs as it is; the next time it is recorded; from then
        on it replays the recording and its body is skipped. The code after the loop (clipping, the
        optimizer's step) runs as it is, and finds the gradients on the parameters.

        The body fetches its batches through a function wrapped by :meth:`timed` (``X, Y =
        get_batch('train')``, before or after the forward pass): a replay calls it again with the
        same arguments, between the graphs, and the body's tensors read what it returns. So the
        function must draw a new batch each call (an index the loop passes would be the
        recording's for ever), of one shape. Tensors the body returns or binds (``loss``) are
        overwritten by each replay. A loop is known by where it is written, its items, and the
        models and optimizers (and ``self``) among the variables of the code around it.

        With several processes the gradient all-reduce is recorded inside the graphs, as in
        :meth:`capture`; a micro-step that keeps its gradients local (``with acc.no_sync(model)``,
        or nanoGPT's ``model.require_backward_grad_sync = False``) records none.

        Where it cannot be captured (no GPU, fp16, FSDP, a body that waits for the GPU or fetches
        nothing through :meth:`timed`) it runs as it is, after one warning naming the cause
        (``strict=True``: a GpuaccelError)."""
        items = list(items)
        caller = sys._getframe(1)
        # which loop: where it is written, its items, and the models and optimizers the code around it
        # holds (and its ``self``): a helper called with another model must not replay the first one's
        held = sorted(id(value) for name, value in caller.f_locals.items()
                      if name == "self" or isinstance(value, (nn.Module, torch.optim.Optimizer)))
        key = (caller.f_code, caller.f_lineno, tuple(held), tuple(
            x if isinstance(x, (int, float, str, bool, type(None))) else (type(x), id(x)) for x in items))
        loop = self._captured_loops.get(key)
        if loop is None:
            obstacle = self._capture_obstacle()
            if obstacle is not None:
                if strict:
                    raise GpuaccelError(f"captured(): {obstacle}")
                warnings.warn(f"captured(): {obstacle}: the loop runs uncaptured", stacklevel=2)
            else:
                self._average_in_graphs()
            loop = self._captured_loops[key] = CapturedLoop(items, self.device, self._trained_parameters,
                                                            warmup=warmup, strict=strict, uncaptured=obstacle)
        return loop

    def _trained_parameters(self) -> list[torch.Tensor]:
        """The parameters of the prepared models and optimizers, each once."""
        found = {}
        for model in list(self._strategies.keys()):
            found.update((id(p), p) for p in model.parameters())
        for optimizer in self._optimizers:
            found.update((id(p), p) for group in optimizer.param_groups for p in group["params"])
        return list(found.values())

    def _shards(self) -> bool:
        """Whether models are sharded (FSDP) here."""
        return self.strategy_name == "fsdp" or isinstance(self._given_strategy, Sharded) or \
            any(isinstance(s, Sharded) for s in self._strategies.values())

    def _capture_obstacle(self) -> str | None:
        """Why a step of the prepared models cannot be one CUDA graph (``capture_obstacle``), or None."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        strategies = list(self._strategies.values()) + [self._given_strategy]
        modules = [m for model in self._strategies.keys() for m in model.modules()]
        return capture_obstacle(
            self.device, self.precision, sharded=self._shards(),
            pipelined=any(isinstance(s, PipelineParallel) for s in strategies),
            sync_batchnorm=any(isinstance(m, nn.SyncBatchNorm) for m in modules),
            checkpointed=any(isinstance(m, CheckpointWrapper) for m in modules),
            compiled_graphs=self.compile and self.compile_mode == "reduce-overhead")

    def _average_in_graphs(self) -> None:
        """With several processes, each prepared DDP model from now on averages its gradients in
        ``backward``, recorded inside the graph, as the trainer's captured step does
        (``GraphDataParallel.from_ddp``)."""
        if not self.dist.active:
            return
        taken = [model for model, strategy in self._strategies.items() if isinstance(strategy, DataParallel)]
        for model in taken:
            self._strategies[model] = GraphDataParallel.from_ddp(self._strategies[model])
        if taken:
            gc.collect()  # (the gradient accumulators the reducers held)

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        """Clips the gradients' norm (unscaled first, under fp16); returns the norm before.
        ``parameters``: an iterable of them, or a prepared model (its strategy clips: a sharded or
        pipelined model's norm is the whole model's)."""
        for optimizer in self._scaled:
            optimizer.unscale()
        strategy = self._strategy_of(parameters) if isinstance(parameters, nn.Module) else None
        if strategy is not None:
            return strategy.clip_gradients(max_norm)
        if isinstance(parameters, nn.Module):
            parameters = parameters.parameters()
        return nn.utils.clip_grad_norm_(parameters, max_norm)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        """Keeps gradients local for a micro-batch of an accumulation (no all-reduce)."""
        strategy = self._strategy_of(model)
        if strategy is None:
            raise GpuaccelError("no_sync() takes a model that prepare() returned")
        self._syncing = False
        try:
            with strategy.gradient_sync(False):
                yield
        finally:
            self._syncing = True
        if isinstance(strategy, Sharded):
            strategy.gradient_sync(True)

    def _strategy_of(self, model: nn.Module) -> Strategy | None:
        """The strategy of a prepared model, also seen through the wrappers around it (torch.compile's,
        DDP's)."""
        while model is not None:
            strategy = self._strategies.get(model)
            if strategy is not None:
                return strategy
            for wrapped in self._strategies.values():
                if wrapped.training_module is model:
                    return wrapped
            model = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        return None

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor`` concatenated along dimension 0 (each process gets it all)."""
        if not self.dist.active:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def end(self) -> None:
        """Ends a run: stops the GPU sampler and frees the captured loops; with several processes,
        waits for every process, releases the captured steps and the parallel wrappers this
        accelerator made, then leaves the process group. Call it last (the prepared models no
        longer synchronise afterwards). Destroying the group while a DDP wrapper still held it left
        one process of two hanging in the wrapper's destructor about one run in four (torch 2.13,
        gloo, two CPU processes)."""
        if self._sampler is not None:
            self._sampler.stop()
        for loop in self._captured_loops.values():  # (their graphs and the gradients and batches they hold)
            loop.release()
        self._captured_loops.clear()
        if not self.dist.active or not torch.distributed.is_initialized():
            return
        self.dist.barrier()
        for step in list(self._captured_steps):  # a graph holding an NCCL all-reduce must go before its group
            step.release()
        for strategy in list(self._strategies.values()):
            if isinstance(strategy, DataParallel):
                strategy.drop_reducer()  # (the reducer holds the process group)
        self._strategies.clear()
        gc.collect()
        self.dist.close()

    # ------------------------------------------------------------------ measuring

    def monitor(self, path: Path | None = None, *, origin: float | None = None) -> GpuSampler | None:
        """Starts sampling the GPU's utilisation, memory and power in the background (NVML), for
        :meth:`stats` (and into ``path`` as JSON lines, with times in seconds since ``origin``, a
        ``time.perf_counter()`` value); a sampler started before stops. :meth:`stats` then counts
        from here. Returns the sampler (None off a GPU). ``monitor=True`` starts one at once."""
        if self._sampler is not None:
            self._sampler.stop()
        self._sampler = GpuSampler(path, [self.device.index or 0], origin=origin) \
            if self.device.type == "cuda" else None
        if self._sampler is not None:
            self._sampler.start()
        self._data_wait.reset()
        self._stats_since = 0.0
        return self._sampler

    def timed(self, get_batch):
        """``get_batch`` (a function that returns a batch, e.g. a script's own ``get_batch(split)``),
        with the wait for each call counted in :meth:`stats`' data wait, as the prepared loaders'
        batches are; or an iterable of batches, each one's wait counted alike."""
        meter = self._data_wait
        if not callable(get_batch):
            return meter.timed(get_batch)

        call = functools.partial(meter.time_call, get_batch)

        @functools.wraps(get_batch)
        def timed_call(*args, **kwargs):
            loop = active_loop()  # (inside a captured loop's body: the loop fetches, between its graphs)
            return call(*args, **kwargs) if loop is None else loop.fetch(get_batch, call, args, kwargs)
        return timed_call

    def stats(self) -> dict:
        """Since the previous call (or the first batch): the seconds, the share of them spent
        waiting for batches (of the prepared loaders and :meth:`timed` functions, read off the
        GPU's timeline, as ``Trainer`` reports its data wait), and the GPU's mean utilisation (%),
        memory used (MiB) and power (W) from NVML samples (None without them; ``gpu_monitor`` says
        why). It waits for the GPU: call it where the loop would anyway, e.g. once per epoch."""
        waited = self._data_wait.read()
        sampler = self._sampler
        now = time.perf_counter() - sampler.origin if sampler is not None and sampler.origin is not None else 0.0
        gpu = {name: (round(value, 1) if value is not None else None)
               for name, value in ((f"gpu_{field}", sampler.mean(field, since=self._stats_since) if sampler else None)
                                   for field in ("util", "mem_used_mib", "power_w"))}
        self._stats_since = now
        return {"seconds": round(waited["total_seconds"], 4), "data_wait_share": round(waited["data_share"], 4),
                **gpu, "gpu_monitor": "no GPU in use" if sampler is None else sampler.unavailable or "nvml"}

    # ------------------------------------------------------------------ state

    def _state_of(self, obj):
        if isinstance(obj, nn.Module):
            strategy = self._strategy_of(obj)
            if strategy is not None:
                return strategy.gather_state(None)[0]
            module = getattr(obj, "_orig_mod", obj)  # (no '_orig_mod.' prefixes from a compiled model)
            return {k: v.detach().cpu() for k, v in module.state_dict().items()}
        if hasattr(obj, "state_dict"):
            return obj.state_dict()
        return obj  # a plain value: a number, a string, a list or dict of them, a tensor

    def _sharded(self, objects: dict):
        """With ``strategy="fsdp"``: (the one prepared model's sharded module, the optimizer or
        None, the other objects by name), as a sharded save writes them; None otherwise."""
        if not self._shards():
            return None
        models = [o for o in objects.values() if isinstance(o, nn.Module) and
                  isinstance(self._strategy_of(o), Sharded)]
        optimizers = [o for o in objects.values() if isinstance(o, torch.optim.Optimizer)]
        if len(models) != 1 or len(optimizers) > 1:
            raise GpuaccelError("a sharded save takes one prepared model and at most one optimizer (it pairs "
                                "the optimizer's state with that model's shards)")
        rest = {n: o for n, o in objects.items() if o is not models[0] and not any(o is p for p in optimizers)}
        optimizer = getattr(optimizers[0], "optimizer", optimizers[0]) if optimizers else None
        return self._strategy_of(models[0]).model, optimizer, rest

    def save(self, path, **objects) -> None:
        """Writes the named objects' state to ``path`` atomically, from the main process: models (a
        prepared model's plain weights), optimizers, schedulers, anything with ``state_dict``, and
        plain values (``step=5``, ``best=0.91``, lists and dicts of them, tensors), with the loss
        scaler's and every process's random number generators' states (a collective: every
        process calls it). The file is the form ``Trainer``'s checkpoints take
        (``runtime/state.py``). With ``strategy="fsdp"``, ``path`` becomes a
        folder of torch.distributed.checkpoint shards instead: each process writes its own part
        of the model and optimizer, nothing is gathered, and every process calls it."""
        reserved = sorted({"format", "version", "_scaler", RNG} & set(objects))
        if reserved:
            raise GpuaccelError(f"save(): {', '.join(reserved)} is a name the file keeps for itself; name the "
                                f"object otherwise")
        sharded = self._sharded(objects)
        if sharded is not None:
            model, optimizer, rest = sharded
            rest = {n: self._state_of(o) for n, o in rest.items()}
            save_sharded(path, model, optimizer,
                         {**rest, "_scaler": self.scaler.state_dict(), RNG: self.dist.gather(rng_state())})
            return
        state = {name: self._state_of(obj) for name, obj in objects.items()}
        state.update({"_scaler": self.scaler.state_dict(), RNG: self.dist.gather(rng_state())})  # (each process's)
        if self.is_main:
            write_state(Path(path), state)
        self.dist.barrier()

    def load(self, path, **objects) -> dict:
        """Restores what :meth:`save` wrote into the named objects (every process reads the file),
        and each process's random number generators (where as many processes saved them); returns
        everything the file holds by name, the plain values among it (``acc.load(path,
        model=model)["step"]``). A ``Trainer`` run's checkpoint.pt or model.pt loads alike:
        ``acc.load("run/checkpoint.pt", model=model, optimizer=optimizer)``."""
        path = Path(path)
        if path.is_dir():
            sharded = self._sharded(objects)
            if sharded is None:
                raise GpuaccelError(f"{path} is a sharded checkpoint: load it into a model prepared with "
                                    f"strategy='fsdp'")
            model, optimizer, rest = sharded
            state = load_sharded(path, model, optimizer)
            self._restore(path, {n: o for n, o in rest.items()}, state)
            return state
        if not path.is_file():
            raise GpuaccelError(f"{path} does not exist")
        state = read_state(path, unversioned=lambda s: "_scaler" in s)  # (and save()'s files before the header)
        self._restore(path, objects, state)
        return state

    def _restore(self, path: Path, objects: dict, state: dict) -> None:
        missing = sorted(set(objects) - set(state))
        if missing:
            held = [k for k in state if not k.startswith("_") and k not in ("format", "version")]
            raise GpuaccelError(f"{path} holds no state for {', '.join(missing)} (it has: {', '.join(held)})")
        for name, obj in objects.items():
            if state[name] is None and state.get("shards"):
                raise GpuaccelError(f"{path} is a sharded Trainer run's checkpoint: its {name} state is in the shards "
                                    f"folder {state['shards']} beside it (load the run's model.pt for its weights)")
            strategy = self._strategy_of(obj) if isinstance(obj, nn.Module) else None
            if isinstance(strategy, Sharded):  # a whole state dict into a sharded model: each takes its shards
                load_full_state(strategy.model, None, state[name], None)
            elif strategy is not None:
                strategy.model.load_state_dict(state[name])
            elif isinstance(obj, nn.Module):
                getattr(obj, "_orig_mod", obj).load_state_dict(state[name])
            elif hasattr(obj, "load_state_dict"):
                obj.load_state_dict(state[name])
            else:
                raise GpuaccelError(f"load() restores into objects with load_state_dict; {name}= is a "
                                    f"{type(obj).__name__} (read plain values from what load() returns)")
        scaler = state.get("_scaler", state.get("scaler"))  # (a Trainer's checkpoint names it 'scaler')
        if scaler is not None:
            self.scaler.load_state_dict(scaler)
        by_process = state.get(RNG) or ([state["rng"]] if isinstance(state.get("rng"), dict) else [])
        if len(by_process) == self.world_size:  # (each process its own; a Trainer's: the one process's)
            set_rng_state(by_process[self.rank])


_latest: dict = {}  # the Accelerator made last in this process (a weak reference): what gpuaccel.capture uses


def capture(step_fn=None, *, warmup: int = 3, strict: bool = False):
    """``@gpuaccel.capture``: :meth:`Accelerator.capture` for a step defined before its accelerator
    exists (a module-level function of a script): the step is captured, at its first call, by
    the ``Accelerator`` this process made last."""
    if step_fn is None:
        return functools.partial(capture, warmup=warmup, strict=strict)
    return _CaptureAtFirstCall(step_fn, warmup=warmup, strict=strict)


class _CaptureAtFirstCall:
    def __init__(self, fn, **options):
        self.fn, self.options, self.step = fn, options, None
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args):
        if self.step is None:
            accelerator = _latest.get("accelerator", lambda: None)()
            if accelerator is None:
                raise GpuaccelError(f"@gpuaccel.capture: create a gpuaccel.Accelerator before the first call of "
                                    f"{self.fn.__name__}()")
            self.step = accelerator.capture(self.fn, **self.options)
        return self.step(*args)

    @property
    def captured(self) -> bool:
        return self.step is not None and self.step.captured


def _compiled_like(compiled: nn.Module, module: nn.Module, mode: str) -> nn.Module:
    """``module`` compiled as ``compiled`` (a user's torch.compile wrapper) compiles what it wraps:
    with the same backend and options; where torch's wrapper cannot be made again, in ``mode``."""
    context = getattr(compiled, "dynamo_ctx", None)
    if module is getattr(compiled, "_orig_mod", None):
        return compiled
    try:
        return type(compiled)(module, context)
    except (TypeError, AttributeError):
        return compile_module(module, mode)
