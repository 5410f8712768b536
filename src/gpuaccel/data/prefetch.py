"""Preparing batches ahead of the training step, on background threads.

The threads share the GIL with the training thread, which launches thousands of kernels
per step from Python; that contention is part of what the streaming pipeline loses end to
end (on an H200 a busy Python thread beside the pipeline took it from about 15k to 69
img/s, because every GIL hand-over waits out the switch interval; benchmarks/stream_stages.py
--under-load). A child process with CUDA IPC buffers was tried and was slower still: two
processes' CUDA contexts time-slice the GPU instead of running their kernels side by side
(no MPS). Numbers: the issue notes of the streaming loader and docs/results.md.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch


Batch = tuple[torch.Tensor, torch.Tensor]
T = TypeVar("T")


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A CUDA stream of high priority for preparing batches on ``device`` (so their few kernels
    go ahead of the training step's), or None off the GPU. Make one per loader and keep it:
    PyTorch's caching allocator reuses a freed block only for the stream it was allocated
    on, and hands out new streams round-robin from a pool, so a stream per epoch kept
    several epochs' worth of cached batch memory that no later epoch could use."""
    return torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None


def in_threads(steps: Iterable[T], make: Callable[[T], Batch], sides: list[torch.cuda.Stream | None],
               depth: int = 3) -> Iterator[Batch]:
    """``make(step)`` for each of ``steps``, in order, made ahead by one background thread per
    entry of ``sides``, each on its stream there (from :func:`side_stream`, one per thread; None
    off the GPU). At most ``depth`` + 1 steps are taken and not yet yielded: ``depth`` made and
    waiting, as in a queue of that size, and one more being made.

    Steps are taken in order under a lock, so ``steps`` may be a generator that reads; making
    them is what runs side by side. Why more than one thread: a step can block its thread for
    longer than the training step takes (nvJPEG waiting for its per-image work behind
    training's kernels), and a second thread overlaps two such waits. An exception, from
    ``steps`` or ``make``, is raised again in the consumer's thread at its place in the order."""
    if not sides:
        raise ValueError("in_threads needs at least one stream entry (None off the GPU)")
    iterator = iter(steps)
    take = threading.Lock()  # one thread at a time reads the next step, so steps keep their order
    turn = threading.Condition()  # guards what follows; the consumer never waits behind a read
    made: dict[int, object] = {}  # order -> (x, y, ready event) or the exception that took its place
    taken, consumed, end = 0, 0, None  # steps handed out; yielded; where the steps ran out
    stop = threading.Event()

    def finish(order: int, result=None, last: int | None = None) -> None:
        nonlocal end
        with turn:
            if result is not None:
                made[order] = result
            if last is not None:
                end = last if end is None else min(end, last)
            turn.notify_all()

    def produce(side) -> None:
        nonlocal taken
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            while True:
                with take:
                    with turn:
                        while not stop.is_set() and end is None and taken - consumed > depth:
                            turn.wait(0.1)
                        if stop.is_set() or end is not None:
                            return
                        order = taken
                    try:
                        step = next(iterator)
                    except StopIteration:
                        return finish(order, last=order)
                    except BaseException as exc:  # raised again in the consumer's thread
                        return finish(order, exc, last=order + 1)
                    with turn:
                        taken += 1
                try:
                    x, y = make(step)
                    done = None
                    if side is not None:
                        done = torch.cuda.Event()
                        done.record(side)
                    finish(order, (x, y, done))
                except BaseException as exc:
                    return finish(order, exc, last=order + 1)

    workers = [threading.Thread(target=produce, args=(side,), daemon=True, name=f"gpuaccel-prefetch-{k}")
               for k, side in enumerate(sides)]
    for worker in workers:
        worker.start()
    try:
        while True:
            with turn:
                while consumed not in made and (end is None or consumed < end):
                    turn.wait()
                if consumed not in made:
                    return
                item = made.pop(consumed)
                consumed += 1
                turn.notify_all()
            if isinstance(item, BaseException):
                raise item
            x, y, done = item
            if done is not None:
                current = torch.cuda.current_stream(x.device)
                current.wait_event(done)
                x.record_stream(current)
                y.record_stream(current)
            yield x, y
    finally:
        with turn:
            stop.set()
            turn.notify_all()
        for worker in workers:
            worker.join()
        close = getattr(iterator, "close", None)
        if close is not None:  # a generator's own clean-up (locks, readers) runs now, not at collection
            close()

