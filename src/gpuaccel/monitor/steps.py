"""Where the time of training steps goes: waiting for data, or computing.

On a GPU the split is read off the GPU's own timeline. An event is recorded on the
compute stream before the next batch is asked for and another once the batch is
ready; the time between the two is what the GPU spent preparing data or sitting idle
for lack of it (a loader that is behind shows up as idle time there; a host that is
ahead of the GPU adds nothing). On the CPU, where work is synchronous, the host clock
measures the same thing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch


class DataWaitMeter:
    def __init__(self, device: torch.device):
        self.on_gpu = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self._marks: list = []  # (before the batch was asked for, once it was ready) per step
        self._first = None  # the first mark since the last read: where the total time starts
        self._folded = 0.0  # seconds of wait of the marks already summed (and dropped)

    def _now(self):
        if not self.on_gpu:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def timed(self, batches: Iterable) -> Iterator:
        """``batches``, with the wait for each one measured."""
        iterator = iter(batches)
        while True:
            before = self._now()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self._mark(before)
            yield batch

    def time_call(self, get_batch, *args, **kwargs):
        """``get_batch(*args, **kwargs)``, its wait measured like a loader's batch."""
        before = self._now()
        batch = get_batch(*args, **kwargs)
        self._mark(before)
        return batch

    def _mark(self, before) -> None:
        if self._first is None:
            self._first = before
        self._marks.append((before, self._now()))
        if len(self._marks) >= 1024:  # a loop that reads rarely (Accelerator.stats) keeps few events
            self._fold()

    def _fold(self) -> None:
        """Sums the waits whose end the GPU has passed, without waiting for the others."""
        pending = []
        for before, ready in self._marks:
            if not self.on_gpu:
                self._folded += ready - before
            elif ready.query():
                self._folded += before.elapsed_time(ready) / 1000
            else:
                pending.append((before, ready))
        self._marks = pending

    def read(self) -> dict:
        """Seconds waiting for data and in all since the last read (or reset), and the share.
        On a GPU this synchronises; call it where the loop synchronises anyway."""
        if self._first is None:
            return {"data_seconds": 0.0, "total_seconds": 0.0, "data_share": 0.0}
        end = self._now()
        if self.on_gpu:
            end.synchronize()
            wait = self._folded + sum(a.elapsed_time(b) for a, b in self._marks) / 1000
            total = self._first.elapsed_time(end) / 1000
        else:
            wait = self._folded + sum(b - a for a, b in self._marks)
            total = end - self._first
        self.reset()
        return {"data_seconds": wait, "total_seconds": total, "data_share": wait / total if total > 0 else 0.0}
