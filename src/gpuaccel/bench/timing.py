"""Timing work correctly: CUDA events around each call on a GPU, the host clock on the CPU,
always after warm-up calls."""

from __future__ import annotations

import statistics
import time

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


def host_times_ms(fn, repeats: int = 20, warmup: int = 3) -> list[float]:
    """Milliseconds on the host clock for each of ``repeats`` calls of ``fn`` (after ``warmup``
    calls); right for synchronous work, or calls that end with a synchronisation."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return times


def median_ms(fn, device: torch.device, repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds per call of ``fn`` on ``device``."""
    times = cuda_times_ms(fn, repeats, warmup) if device.type == "cuda" else host_times_ms(fn, repeats, warmup)
    return statistics.median(times)


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, tf32: bool = False, repeats: int = 20) -> float:
    """Measured TFLOP/s of an n x n x n matrix multiply (random data, never zeros)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        ms = median_ms(lambda: torch.mm(a, b), device, repeats)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return 2 * n ** 3 / (ms / 1000) / 1e12
