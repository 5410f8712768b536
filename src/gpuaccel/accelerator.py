"""``gpuaccel.Accelerator``: gpuaccel's device, precision, data placement and parallel
strategies for a training loop the user keeps (HF Accelerate's ``prepare``, Lightning
Fabric's ``setup``).

    acc = gpuaccel.Accelerator()
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    for x, y in loader:                       # batches arrive on the device
        with acc.autocast():
            loss = F.cross_entropy(model(x), y)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

It is built from the pieces ``Trainer`` uses, not a second copy of them: the device and
precision choice (``device.py``), the parallel strategies (``parallel/``: one device, DDP,
FSDP), the device-resident tensor loader and the one-step-ahead copies (``data/``), and the
atomic checkpoint files (``files.py``). Under torchrun each process joins the process group,
trains its replica (or shard) and reads its shard of every loader.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

from .compiling import COMPILE_MODES, compile_arguments
from .data.loader import DeviceCopies, resident_budget
from .data.tensors import TensorLoader, gather_tensors
from .device import resolve_device, resolve_precision
from .errors import GpuaccelError, choice_error
from .files import atomic_write
from .monitor.gpu import GpuSampler
from .monitor.steps import DataWaitMeter
from .parallel import DataParallel, Distributed, Sharded, SingleDevice, Strategy
from .parallel.data_parallel import average_gradients
from .parallel.fsdp import load_full_state, load_sharded, save_sharded
from .train.step_graph import CapturedStep

STRATEGIES = ("auto", "ddp", "fsdp")


class Accelerator:
    def __init__(self, device: str = "auto", precision: str = "auto", compile: bool = False,
                 compile_mode: str = "default", strategy: str = "auto", channels_last: bool | None = None,
                 monitor: bool = True):
        """``device``: auto (a CUDA GPU if there is one), cpu, cuda or cuda:N; ``precision``: auto
        (bf16 on GPUs that have it, fp16 with loss scaling on older ones, fp32 on the CPU), fp32,
        bf16 or fp16; ``compile``: torch.compile the prepared models; ``strategy``: with several
        processes, ddp (auto) or fsdp; ``channels_last``: NHWC for models with convolutions
        (default on GPUs); ``monitor``: sample the GPU's utilisation, memory and power in the
        background for :meth:`stats` (NVML, as ``Trainer`` does)."""
        if strategy not in STRATEGIES:
            raise choice_error("strategy", strategy, STRATEGIES)
        if compile_mode not in COMPILE_MODES:
            raise choice_error("compile mode", compile_mode, COMPILE_MODES)
        self.dist = Distributed.from_env()
        self.device = self.dist.device(device) if self.dist.active else resolve_device(device)
        self.dist.init(self.device)
        self.precision = resolve_precision(precision, self.device)
        self.compile, self.compile_mode, self.strategy_name = compile, compile_mode, strategy
        self.channels_last = channels_last
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision.loss_scaling)
        self._strategies: "weakref.WeakKeyDictionary[nn.Module, Strategy]" = weakref.WeakKeyDictionary()
        self._layout = torch.contiguous_format  # of image batches: channels_last once a model is
        self._optimizers: list[PreparedOptimizer] = []
        self._reduce_in_backward = False  # after capture() with several processes: no DDP hooks
        self._captured_steps: list[CapturedStep] = []
        self._data_wait = DataWaitMeter(self.device)  # fed by the prepared loaders
        self._sampler = GpuSampler(None, [self.device.index or 0]) if monitor and self.device.type == "cuda" \
            else None
        if self._sampler is not None:
            self._sampler.start()
        self._stats_since = 0.0

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
        """Returns each object ready for this device and process, in the order given: a model
        (moved, laid out, wrapped by the parallel strategy, optionally compiled), an optimizer
        (loss scaling in ``step`` where fp16 needs it), a DataLoader (batches on the device, this
        process's shard), a learning-rate scheduler (as it is). ``device_resident``: gather each
        loader's data set onto the device once and batch it there (default: for a TensorDataset
        that fits); False always copies batches from the loader's workers one step ahead."""
        prepared = []
        for obj in objects:
            if isinstance(obj, nn.Module):
                prepared.append(self._prepare_model(obj))
            elif isinstance(obj, torch.optim.Optimizer):
                prepared.append(self._prepare_optimizer(obj))
            elif isinstance(obj, DataLoader):
                prepared.append(self._prepare_loader(obj, device_resident))
            elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                prepared.append(obj)
            else:
                raise GpuaccelError(f"prepare() takes models, optimizers, DataLoaders and schedulers, not "
                                    f"{type(obj).__name__}")
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _strategy(self) -> Strategy:
        place = dict(device=self.device, rank=self.rank, world_size=self.world_size)
        if self.strategy_name == "fsdp":
            return Sharded(**place)
        if self.dist.active:
            return DataParallel(**place)
        return SingleDevice(**place)

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
        channels_last = (self.device.type == "cuda" and has_conv) if self.channels_last is None \
            else self.channels_last
        # FSDP shards contiguous parameters only
        layout = torch.channels_last if channels_last and self.strategy_name != "fsdp" else torch.preserve_format
        model.to(self.device, memory_format=layout)
        if channels_last:
            self._layout = torch.channels_last  # the loaders lay out image batches to match
        strategy = self._strategy()
        strategy.wrap(model)
        prepared = strategy.training_module
        if self.compile:
            prepared = torch.compile(prepared, **compile_arguments(self.compile_mode))
        self._strategies[prepared] = strategy
        return prepared

    def _prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> "PreparedOptimizer":
        if self.strategy_name == "fsdp":
            from torch.distributed.tensor import DTensor

            if any(not isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]):
                raise GpuaccelError("with strategy='fsdp', create the optimizer from the prepared model's "
                                    "parameters: model = acc.prepare(model), then optimizer, then "
                                    "acc.prepare(optimizer)")
        prepared = PreparedOptimizer(optimizer, self.scaler)
        self._optimizers.append(prepared)
        return prepared

    def _prepare_loader(self, loader: DataLoader, device_resident: bool | None):
        shuffle = isinstance(loader.sampler, RandomSampler)
        dataset = loader.dataset
        tensors = None
        if device_resident is not False and loader.batch_size is not None and \
                (device_resident or isinstance(dataset, TensorDataset)):
            tensors = gather_tensors(dataset, resident_budget(self.device))
            if tensors is None and device_resident:
                raise GpuaccelError("device_resident=True: the data set's items do not stack into tensors that "
                                    "fit on the device (or they change from one read to the next)")
        if tensors is not None:
            # every process must draw the same order to take disjoint shards of it: rank 0's seed
            seed = self.dist.broadcast(torch.initial_seed() % 2**31) if self.dist.active else \
                torch.initial_seed() % 2**31
            return ResidentLoader(tensors, batch_size=loader.batch_size, device=self.device, shuffle=shuffle,
                                  drop_last=loader.drop_last, rank=self.rank, world_size=self.world_size, seed=seed,
                                  layout=self._layout, meter=self._data_wait)
        if self.dist.active and not isinstance(loader.sampler, DistributedSampler):
            sampler = DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle)
            loader = DataLoader(dataset, batch_size=loader.batch_size, sampler=sampler,
                                num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                                pin_memory=self.device.type == "cuda", drop_last=loader.drop_last,
                                persistent_workers=loader.persistent_workers)
        return PrefetchLoader(loader, self.device, layout=self._layout, meter=self._data_wait)

    # ------------------------------------------------------------------ the step

    def autocast(self):
        """The precision's autocast context for the forward pass and the loss."""
        return self.precision.autocast(self.device)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled where fp16 needs it."""
        self.scaler.scale(loss).backward()
        if self._reduce_in_backward:
            average_gradients([p.grad for model in self._strategies for p in model.parameters() if p.grad is not None])

    def capture(self, step_fn, *, warmup: int = 3) -> CapturedStep:
        """``step_fn`` (forward, ``acc.backward``, optimizer step, all on the batch it is given)
        as one CUDA graph: the first ``warmup`` calls run it as it is, the next records and
        replays it, every later call only copies its batch in and replays (one launch for the
        whole step). With several processes the gradient all-reduce is recorded inside it
        (``acc.backward`` does it, in place of DDP's hooks). What it returns is overwritten by the
        next call. Off a GPU the step runs uncaptured, with one notice."""
        if self.strategy_name == "fsdp":
            raise GpuaccelError("capture() is not available with strategy='fsdp' (FSDP gathers and frees "
                                "parameters on the host between layers); use strategy='ddp'")
        if self.compile and self.compile_mode == "reduce-overhead":
            raise GpuaccelError("capture() records the whole step as one CUDA graph already; use compile_mode="
                                "'default' (compiled kernels without torch.compile's own graphs)")
        if self.precision.loss_scaling:
            raise GpuaccelError("capture() needs bf16 or fp32: fp16's loss scaling decides on the host whether "
                                "each step is taken; use precision='bf16' (or fp32)")
        if self.device.type != "cuda":
            warnings.warn("capture(): CUDA graphs need a GPU; on the CPU the step runs uncaptured", stacklevel=2)
        elif self.dist.active:
            self._without_ddp_hooks()
        step = CapturedStep(step_fn, [o.optimizer for o in self._optimizers], self.device, warmup=warmup)
        self._captured_steps.append(step)
        return step

    def _without_ddp_hooks(self) -> None:
        """Data parallel as the trainer's step graph does it (parallel/graph_data_parallel.py):
        DDP's reducer runs hooks on the host during the backward pass, which a replay skips, and
        it keeps each parameter's gradient accumulator from the stream it was made on, which a
        capture may not wait for. So each prepared DDP model calls its module directly from now
        on, without the reducer, and ``backward`` averages the gradients in one all-reduce,
        recorded inside the graph. (Replicas start equal: DDP broadcast rank 0's at prepare.)"""
        for strategy in self._strategies.values():
            if isinstance(strategy, DataParallel) and strategy.ddp is not None and strategy.ddp.reducer is not None:
                strategy.ddp.forward = strategy.ddp.module.forward
                strategy.ddp.reducer = strategy.ddp.logger = None  # (the logger holds the reducer too)
        gc.collect()  # (the accumulators the reducer held)
        self._reduce_in_backward = True

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        """Clips the gradients' norm (unscaled first, under fp16); returns the norm before."""
        if self.scaler.is_enabled():
            for optimizer in self._optimizers:
                optimizer.unscale()
        return nn.utils.clip_grad_norm_(parameters, max_norm)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        """Keeps gradients local for a micro-batch of an accumulation (no all-reduce)."""
        strategy = self._strategies.get(model)
        if strategy is None:
            raise GpuaccelError("no_sync() takes a model that prepare() returned")
        with strategy.gradient_sync(False):
            yield
        if isinstance(strategy, Sharded):
            strategy.gradient_sync(True)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor`` concatenated along dimension 0 (each process gets it all)."""
        if not self.dist.active:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def end(self) -> None:
        """Ends a run: stops the GPU sampler; with several processes, waits for every process,
        releases the captured steps and the parallel wrappers this accelerator made, then leaves
        the process group. Call it last (the prepared models no longer synchronise afterwards).
        Destroying the group while a DDP wrapper still held it
        left one process of two hanging in the wrapper's destructor about one run in four
        (torch 2.13, gloo, two CPU processes)."""
        if self._sampler is not None:
            self._sampler.stop()
        if not self.dist.active or not torch.distributed.is_initialized():
            return
        self.dist.barrier()
        for step in self._captured_steps:  # a graph holding an NCCL all-reduce must go before its group
            step.release()
        for strategy in list(self._strategies.values()):
            if isinstance(strategy, DataParallel) and strategy.ddp is not None:
                strategy.ddp.reducer = None  # (the reducer holds the process group)
        self._strategies.clear()
        gc.collect()
        self.dist.close()

    def stats(self) -> dict:
        """Since the previous call (or the first batch): the seconds, the share of them spent
        waiting for the prepared loaders' batches (read off the GPU's timeline, as ``Trainer``
        reports its data wait), and the GPU's mean utilisation (%), memory used (MiB) and power
        (W) from NVML samples (None without them; ``gpu_monitor`` says why). It waits for the
        GPU: call it where the loop would anyway, e.g. once per epoch."""
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
            strategy = self._strategies.get(obj)
            return strategy.gather_state(None)[0] if strategy is not None else \
                {k: v.detach().cpu() for k, v in obj.state_dict().items()}
        return obj.state_dict()

    def _sharded(self, objects: dict):
        """With ``strategy="fsdp"``: (the one prepared model's sharded module, the optimizer or
        None, the other objects by name), as a sharded save writes them; None otherwise."""
        if self.strategy_name != "fsdp":
            return None
        models = [o for o in objects.values() if isinstance(self._strategies.get(o), Sharded)]
        optimizers = [o for o in objects.values() if isinstance(o, (PreparedOptimizer, torch.optim.Optimizer))]
        if len(models) != 1 or len(optimizers) > 1:
            raise GpuaccelError("a sharded save takes one prepared model and at most one optimizer (it pairs "
                                "the optimizer's state with that model's shards)")
        rest = {n: o for n, o in objects.items() if o is not models[0] and not any(o is p for p in optimizers)}
        optimizer = getattr(optimizers[0], "optimizer", optimizers[0]) if optimizers else None
        return self._strategies[models[0]].model, optimizer, rest

    def save(self, path, **objects) -> None:
        """Writes the named objects' state (models, optimizers, schedulers, any object with
        ``state_dict``) to ``path`` atomically, from the main process. With ``strategy="fsdp"``,
        ``path`` becomes a folder of torch.distributed.checkpoint shards: each process writes its
        own part of the model and optimizer, nothing is gathered, and every process calls it."""
        sharded = self._sharded(objects)
        if sharded is not None:
            model, optimizer, rest = sharded
            save_sharded(path, model, optimizer,
                         {**{n: o.state_dict() for n, o in rest.items()}, "_scaler": self.scaler.state_dict()})
            return
        state = {name: self._state_of(obj) for name, obj in objects.items()}
        state["_scaler"] = self.scaler.state_dict()
        if self.is_main:
            atomic_write(Path(path), lambda f: torch.save(state, f))
        self.dist.barrier()

    def load(self, path, **objects) -> None:
        """Restores what :meth:`save` wrote into the named objects (every process reads the file)."""
        path = Path(path)
        if path.is_dir():
            sharded = self._sharded(objects)
            if sharded is None:
                raise GpuaccelError(f"{path} is a sharded checkpoint: load it into a model prepared with "
                                    f"strategy='fsdp'")
            model, optimizer, rest = sharded
            extra = load_sharded(path, model, optimizer)
            for name, obj in rest.items():
                if name not in extra:
                    raise GpuaccelError(f"{path} holds no state for {name}")
                obj.load_state_dict(extra[name])
            self.scaler.load_state_dict(extra["_scaler"])
            return
        if not path.is_file():
            raise GpuaccelError(f"{path} does not exist")
        state = torch.load(path, map_location="cpu", weights_only=True)
        missing = sorted(set(objects) - set(state))
        if missing:
            raise GpuaccelError(f"{path} holds no state for {', '.join(missing)} (it has: "
                                f"{', '.join(k for k in state if not k.startswith('_'))})")
        for name, obj in objects.items():
            strategy = self._strategies.get(obj) if isinstance(obj, nn.Module) else None
            if isinstance(strategy, Sharded):  # a whole state dict into a sharded model: each takes its shards
                load_full_state(strategy.model, None, state[name], None)
            elif strategy is not None:
                strategy.model.load_state_dict(state[name])
            else:
                obj.load_state_dict(state[name])
        self.scaler.load_state_dict(state["_scaler"])


class PreparedOptimizer:
    """The user's optimizer; ``step`` goes through the loss scaler under fp16 (it skips a step
    whose gradients overflowed and adjusts the scale). Everything else is the optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler):
        self.optimizer, self.scaler = optimizer, scaler
        self._unscaled = False

    def unscale(self) -> None:
        if not self._unscaled:
            self.scaler.unscale_(self.optimizer)
            self._unscaled = True

    def step(self, closure=None):
        self._unscaled = False
        if not self.scaler.is_enabled():
            return self.optimizer.step(closure)
        result = self.scaler.step(self.optimizer)
        self.scaler.update()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name):
        return getattr(self.optimizer, name)


class ResidentLoader:
    """A DataLoader's data set gathered onto the device once: each epoch (each ``iter``) is a
    new seeded order, this process's shard, batched by indexing on the device."""

    def __init__(self, tensors, *, batch_size: int, device: torch.device, shuffle: bool, drop_last: bool,
                 rank: int, world_size: int, seed: int, layout=torch.contiguous_format,
                 meter: DataWaitMeter | None = None):
        self._loader = TensorLoader(tensors, batch_size=batch_size, device=device, train=shuffle, seed=seed,
                                    rank=rank, world_size=world_size, drop_last=drop_last)
        self.layout, self.meter = layout, meter or DataWaitMeter(device)
        self.epoch = 0

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator:
        epoch, self.epoch = self.epoch, self.epoch + 1
        return self.meter.timed(_laid_out(batch, self.layout) for batch in self._loader.batches(epoch))


class PrefetchLoader:
    """A DataLoader whose batches arrive on the device, copied from pinned memory one step
    ahead on a side stream (``set_epoch`` on a DistributedSampler at each ``iter``)."""

    def __init__(self, loader: DataLoader, device: torch.device, layout=torch.contiguous_format,
                 meter: DataWaitMeter | None = None):
        self.loader, self.device, self.layout = loader, device, layout
        self.meter = meter or DataWaitMeter(device)
        self._copies = DeviceCopies(device)
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        if hasattr(self.loader.sampler, "set_epoch"):
            self.loader.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return self.meter.timed(_laid_out(batch, self.layout) for batch in self._copies(iter(self.loader)))


def _laid_out(batch, layout):
    """Image batches (4-D floating tensors) in the prepared model's memory layout, as the
    trainer's loaders deliver them: a channels-last convolution fed NCHW would convert it itself,
    every layer."""
    if layout is torch.contiguous_format:
        return batch
    return tree_map(lambda t: t.contiguous(memory_format=layout)
                    if isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point() else t, batch)
