"""Timing GPU work correctly: CUDA events around each call, after warm-up calls."""

from __future__ import annotations

import torch


def cuda_times_ms(fn, repeats: int = 20, warmup: int = 3) -> list[float]:
    """Milliseconds of GPU time for each of ``repeats`` calls of ``fn`` (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times
