"""Preparing batches ahead of the training step, on background threads.

The threads share the GIL with the training thread, which launches thousands of kernels
per step from Python; that contention is part of what the streaming pipeline loses end to
end (a busy Python thread beside the pipeline slowed it by orders of magnitude, because every
GIL hand-over waits out the switch interval). A child process with CUDA IPC buffers was tried and was slower still: two
processes' CUDA contexts time-slice the GPU instead of running their kernels side by side
(no MPS). The numbers: docs/results.md, "ResNet-50".
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

from ..background import stop_at_exit

Batch = tuple[torch.Tensor, torch.Tensor]
# at exit, the seconds the threads of a pass are waited for: one blocked in a read (a reader process
# gone) is left to the interpreter rather than holding the process
_EXIT_WAIT = 5.0
T = TypeVar("T")


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A CUDA stream of high priority for preparing batches on ``device`` (so their few kernels
    go ahead of the training step's), or None off the GPU. Make one per loader and keep it:
    PyTorch's caching allocator reuses a freed block only for the stream it was allocated
    on, and hands out new streams round-robin from a pool, so a stream per epoch kept
    several epochs' worth of cached batch memory that no later epoch could use."""
    return torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None


def in_threads(steps: Iterable[T], make: Callable[[T], Batch], sides: list[torch.cuda.Stream | None],
               depth: int = 3) -> "Prefetched":
    """``make(step)`` for each of ``steps``, in order, made ahead by one background thread per
    entry of ``sides``, each on its stream there (from :func:`side_stream`, one per thread; None
    off the GPU). The threads start at once, before the first batch is asked for, so a loader
    can be set going ahead of its pass (the trainer starts the next epoch's before it
    evaluates). At most ``depth`` + 1 steps are taken and not yet yielded: ``depth`` made and
    waiting, as in a queue of that size, and one more being made.

    Steps are taken in order under a lock, so ``steps`` may be a generator that reads; making
    them is what runs side by side. Why more than one thread: a step can block its thread for
    longer than the training step takes (nvJPEG waiting for its per-image work behind
    training's kernels), and a second thread overlaps two such waits (no gain was measured for
    ResNet-50, docs/results.md). An exception, from
    ``steps`` or ``make``, is raised again in the consumer's thread at its place in the order."""
    if not sides:
        raise ValueError("in_threads needs at least one stream entry (None off the GPU)")
    return Prefetched(iter(steps), make, sides, depth)


class _Making:
    """What the threads of one :class:`Prefetched` share; they hold this, not the iterator, so
    an iterator that nobody holds any more is collected, and its clean-up stops them."""

    def __init__(self, steps: Iterator[T], make: Callable[[T], Batch], depth: int):
        self.steps, self.make, self.depth = steps, make, depth
        self.take = threading.Lock()  # one thread at a time reads the next step, so steps keep their order
        self.turn = threading.Condition()  # guards what follows; the consumer never waits behind a read
        self.made: dict[int, object] = {}  # order -> (x, y, ready event) or the exception in its place
        self.taken, self.consumed, self.end = 0, 0, None  # steps handed out; yielded; where they ran out
        self.stop = threading.Event()

    def finish(self, order: int, result=None, last: int | None = None) -> None:
        with self.turn:
            if result is not None:
                self.made[order] = result
            if last is not None:
                self.end = last if self.end is None else min(self.end, last)
            self.turn.notify_all()

    def produce(self, side) -> None:
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            while True:
                with self.take:
                    with self.turn:
                        while not self.stop.is_set() and self.end is None and self.taken - self.consumed > self.depth:
                            self.turn.wait(0.1)
                        if self.stop.is_set() or self.end is not None:
                            return
                        order = self.taken
                    try:
                        step = next(self.steps)
                    except StopIteration:
                        return self.finish(order, last=order)
                    except BaseException as exc:  # raised again in the consumer's thread
                        return self.finish(order, exc, last=order + 1)
                    with self.turn:
                        self.taken += 1
                try:
                    x, y = self.make(step)
                    done = None
                    if side is not None:
                        done = torch.cuda.Event()
                        done.record(side)
                    self.finish(order, (x, y, done))
                except BaseException as exc:
                    return self.finish(order, exc, last=order + 1)


class Prefetched:
    """The iterator :func:`in_threads` returns. Running out, an exception raised to the
    consumer, :meth:`close` or being collected stops and joins its threads and closes the steps."""

    def __init__(self, steps: Iterator[T], make: Callable[[T], Batch], sides: list, depth: int):
        self._making = _Making(steps, make, depth)
        self._closed = False
        self._workers = [threading.Thread(target=self._making.produce, args=(side,), daemon=True,
                                          name=f"gpuaccel-prefetch-{k}") for k, side in enumerate(sides)]
        for worker in self._workers:
            worker.start()
        stop_at_exit(self, lambda prefetched: prefetched.close(timeout=_EXIT_WAIT))

    def __iter__(self) -> "Prefetched":
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise StopIteration
        making = self._making
        with making.turn:
            while not self._closed and making.consumed not in making.made and \
                    (making.end is None or making.consumed < making.end):
                making.turn.wait()
            item = making.made.pop(making.consumed, None)
            if item is not None:
                making.consumed += 1
                making.turn.notify_all()
        if item is None:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        x, y, done = item
        if done is not None:
            current = torch.cuda.current_stream(x.device)
            current.wait_event(done)
            x.record_stream(current)
            y.record_stream(current)
        return x, y

    def close(self, timeout: float | None = None) -> None:
        """Stops the threads, waits for them (``timeout``: this many seconds at most, in all), and
        closes the steps (a generator's own clean-up, such as releasing a reader, runs now rather
        than at collection; not while a thread that did not stop in time still reads them)."""
        if self._closed:
            return
        making = self._making
        with making.turn:
            self._closed = True
            making.stop.set()
            making.turn.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        for worker in self._workers:
            worker.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        close = getattr(making.steps, "close", None)
        if close is not None and not any(worker.is_alive() for worker in self._workers):
            close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()
