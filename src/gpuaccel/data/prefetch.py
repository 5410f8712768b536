"""Preparing batches ahead of the training step, on a background thread.

The thread shares the GIL with the training thread, which launches thousands of kernels
per step from Python; that contention is part of what the streaming pipeline loses end to
end (on an H200 a busy Python thread beside the pipeline took it from about 15k to 69
img/s, because every GIL hand-over waits out the switch interval; benchmarks/stream_stages.py
--under-load). A child process with CUDA IPC buffers was tried and was slower still: two
processes' CUDA contexts time-slice the GPU instead of running their kernels side by side
(no MPS). Numbers: the issue notes of the streaming loader and docs/results.md.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import torch


Batch = tuple[torch.Tensor, torch.Tensor]


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A CUDA stream of high priority for preparing batches on ``device`` (so their few kernels
    go ahead of the training step's), or None off the GPU. Make one per loader and keep it:
    PyTorch's caching allocator reuses a freed block only for the stream it was allocated
    on, and hands out new streams round-robin from a pool, so a stream per epoch kept
    several epochs' worth of cached batch memory that no later epoch could use."""
    return torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None


def in_thread(prepared: Callable[[], Iterator[Batch]], side: torch.cuda.Stream | None,
              depth: int = 3) -> Iterator[Batch]:
    """The batches of ``prepared()``, made ``depth`` ahead on a background thread, on the
    ``side`` stream (from :func:`side_stream`) when on a GPU."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def hand_over(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def produce() -> None:
        try:
            with torch.cuda.stream(side) if side is not None else _nothing():
                for x, y in prepared():
                    done = None
                    if side is not None:
                        done = torch.cuda.Event()
                        done.record(side)
                    if not hand_over((x, y, done)):
                        return
            hand_over(None)
        except BaseException as exc:  # raised again in the consumer's thread
            hand_over(exc)

    worker = threading.Thread(target=produce, daemon=True, name="gpuaccel-prefetch")
    worker.start()
    try:
        while True:
            item = ready.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            x, y, done = item
            if done is not None:
                current = torch.cuda.current_stream(side.device)
                current.wait_event(done)
                x.record_stream(current)
                y.record_stream(current)
            yield x, y
    finally:
        stop.set()
        while worker.is_alive():  # unblock a producer waiting for room in the queue
            try:
                ready.get(timeout=0.05)
            except queue.Empty:
                pass
        worker.join()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
