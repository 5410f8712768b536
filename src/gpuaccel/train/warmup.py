"""The warm-up before the training clock starts: a few steps on the first batch (and on each
shape a progressive-resizing schedule will make), and an evaluation, so that compilation,
cuDNN's autotuning and the step's CUDA graphs are made then; afterwards every piece of
state is put back as it was, and the step is recorded where the restored state lives."""

from __future__ import annotations

import contextlib
import math
import time
from typing import NamedTuple

import torch

from ..compiling import compile_workers_unless_cached, start_background_compile
from ..data import ImageDataset
from ..data.augment import parse_size_schedule, resize
from ..device import synchronize
from ..monitor.phases import PhaseClock
from ..runtime.capture import signature
from ..runtime.state import rng_state, set_rng_state, snapshot

STEPS = 3  # torch.compile records its CUDA graphs (mode reduce-overhead) on a function's third call
FIRST_STEP = "the first training step per shape (compiling or loading compiled kernels, autotuning, first collectives)"
# A run that uncompiled would train longer than this compiles before it trains, even where it
# could leave the compile to a background process: a cold compile costs 10-45 s (the recipes'
# on an H200, docs/results.md), and compiled steps save about half of a step's time where the
# model is large enough for that to matter
UNCOMPILED_SECONDS = 60.0
# what a background compile needs on the GPU beyond what this process reserved at its peak (its
# own CUDA context, and room for Inductor's autotuning)
SPARE_BYTES = 1 << 30


class WarmedUp(NamedTuple):
    seconds: float
    phases: dict[str, float]  # where the seconds went (each part waits for the device before the next starts)
    setup_by_process: list[dict[str, float]] | None  # with several processes: each one's set-up phases


def warm_up(trainer, evaluate: bool = True, batch=None) -> WarmedUp:
    """Runs :data:`STEPS` training steps on ``batch`` (by default the first of epoch 0) at each
    training shape and (``evaluate``, unless evaluation runs eagerly) an evaluation, puts the
    state back and records the step. Returns how long it took, and where the time went."""
    start = time.perf_counter()
    parts = PhaseClock(since_process_start=False)

    def done(part: str) -> None:
        synchronize(trainer.device)
        parts.mark(part)

    saved = _saved_state(trainer)
    inputs, targets = trainer.task.split(batch if batch is not None else next(iter(trainer.train_loader.batches(0))))
    done("saving the state to put back")
    by_process = None
    if trainer.dist.active:  # (a process that set up slower holds the others at the first collective)
        by_process = trainer.dist.gather(trainer.times.phases.table())  # (and says why)
        done("waiting for the slowest process to arrive")
    shapes = training_shapes(trainer, inputs, targets)
    note = trainer.compiled_note(inputs, targets)  # (None when nothing compiles)
    if trainer.compile_plan == "deferred":
        _plan_compile(trainer, note, shapes[0])
        done("deciding where to compile (importing torch.compile, or timing uncompiled steps)")
    compiling = trainer.compile_plan == "now"
    with compile_workers_unless_cached(note) if compiling else contextlib.nullcontext():
        for shaped in shapes:
            micro_batches = [shaped] * trainer.config.optimizer.grad_accum  # (one optimizer step's)
            trainer.step.warm(micro_batches, steps=1)
            done(FIRST_STEP)
            trainer.step.warm(micro_batches, steps=STEPS - 1)
            done(f"{STEPS - 1} more training steps per shape")
        if evaluate and (trainer.config.runtime.compile_eval or not compiling):
            trainer.evaluate(each_shape=True)  # (--no-compile-eval: cuDNN's first calls are left to the first)
            done("an evaluation")
    _restore(trainer, saved)
    done("putting the state back")
    trainer.step.record()  # last: it records where the restored state lives
    done("recording the step graph")
    return WarmedUp(time.perf_counter() - start, parts.table(), by_process)


def _plan_compile(trainer, note, batch) -> None:
    """Where a deferred compile happens (``Trainer.compile_plan`` "deferred"): in this process
    (plan "now") when this machine compiled the same graphs before, so that they load from the
    cache, or when the run would train uncompiled for longer than :data:`UNCOMPILED_SECONDS`;
    otherwise the run trains uncompiled while a background process compiles for the runs after
    it (plan "background", :func:`compile_model_in_background`), unless that cannot start."""
    if note.compiled_before or note.path is None:
        trainer.compile_now()
        return
    micro_batches = [batch] * trainer.config.optimizer.grad_accum
    trainer.step.warm(micro_batches, steps=1)
    synchronize(trainer.device)
    start = time.perf_counter()
    trainer.step.warm(micro_batches, steps=2)
    synchronize(trainer.device)
    step_seconds = (time.perf_counter() - start) / 2  # (not yet one CUDA graph: an overestimate)
    steps = math.ceil(trainer.config.loop.epochs * trainer.steps_per_epoch) - trainer.state.global_step
    uncompiled = min(steps * step_seconds, trainer.config.loop.time_limit or math.inf)
    if uncompiled > UNCOMPILED_SECONDS or not compile_model_in_background(trainer, note):
        trainer.compile_now()
    else:
        trainer.train_uncompiled()


def compile_model_in_background(trainer, note) -> bool:
    """Starts the background compile of ``trainer``'s graphs (gpuaccel.train.precompile), or
    finds one running; False where the GPU lacks the memory for a second copy of the step
    (measured after the steps just taken) or none can start."""
    free, _ = torch.cuda.mem_get_info(trainer.device)
    if free < torch.cuda.max_memory_reserved(trainer.device) + SPARE_BYTES:
        return False
    return start_background_compile(note, "gpuaccel.train.precompile", trainer.config.to_dict())


def training_shapes(trainer, inputs, targets) -> list[tuple]:
    """(inputs, targets) of each shape training will see: the first batch; a batch of each shape a
    loader says it makes (``shape_examples``: translation's length buckets); and with progressive
    resizing the first batch's images at full size and at each size of the schedule."""
    batches = {signature((inputs, targets)): (inputs, targets)}
    for example in getattr(trainer.train_loader, "shape_examples", lambda: [])():
        split = trainer.task.split(example)
        batches.setdefault(signature(split), split)
    if trainer.config.data.size_schedule and isinstance(trainer.dataset, ImageDataset):
        sizes = [tuple(trainer.dataset.train_images.shape[2:])]
        sizes += [(size, size) for size, _ in parse_size_schedule(trainer.config.data.size_schedule)]
        for size in sizes:
            resized = resize(inputs, size)
            batches.setdefault(signature((resized, targets)), (resized, targets))
    return list(batches.values())


def _saved_state(trainer) -> dict:
    return {"model": snapshot(trainer.model.state_dict(), trainer.device),
            "optimizer": snapshot(trainer.optimizer.state_dict(), trainer.device),
            "scheduler": trainer.scheduler.state_dict(), "scaler": trainer.scaler.state_dict(),
            "ema": snapshot(trainer.ema.state_dict(), trainer.device) if trainer.ema else None,
            "rng": rng_state()}


def _restore(trainer, saved: dict) -> None:
    trainer.model.load_state_dict(saved["model"])
    trainer.optimizer.load_state_dict(saved["optimizer"])
    trainer.scheduler.load_state_dict(saved["scheduler"])
    trainer.scaler.load_state_dict(saved["scaler"])
    if trainer.ema:
        trainer.ema.load_state_dict(saved["ema"])
    set_rng_state(saved["rng"])
