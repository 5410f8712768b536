"""Timing work correctly: CUDA events around each call on a GPU, the host clock on the CPU,
always after warm-up calls."""

from __future__ import annotations

import statistics
import time

import numpy as np
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


def graph_replay(fn, warmup: int = 1):
    """``fn`` recorded as a CUDA graph (after ``warmup`` eager calls on a side stream, as capture
    needs); returns the graph's replay (the graph goes with it). Timing the replay times the GPU's
    work alone, not the host's launches: what a captured training step runs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


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


def measure(call, make_input, *, repeats: int = 200, batches=(64, 256, 1024)) -> dict:
    """Latency percentiles of ``call`` on single inputs and its best throughput over ``batches``
    (``make_input(b)`` makes a batch of ``b``), by the host clock (``call`` synchronises)."""
    x = make_input(1)
    single = host_times_ms(lambda: call(x), repeats, warmup=20)
    best = 0.0
    for b in batches:
        x = make_input(b)
        ms = statistics.median(host_times_ms(lambda: call(x), repeats=max(5, repeats // 20), warmup=3))
        best = max(best, b / (ms / 1000))
    return {"latency_p50_ms": float(np.percentile(single, 50)), "latency_p90_ms": float(np.percentile(single, 90)),
            "latency_p99_ms": float(np.percentile(single, 99)), "best_images_per_second": best}
