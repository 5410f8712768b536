"""Where the GPU stood idle in a torch.profiler trace, and whose launch it was waiting for.

Reads the Chrome trace that ``gpuaccel train --profile`` writes (run_dir/profile/trace.json)
and reports, over the profiled steps:

- the GPU's busy time (any kernel, copy or memset on any stream) and its idle gaps;
- for each gap, the work that ended it: if that work was launched after the gap began, the
  GPU was waiting for a launch (by the training thread or another one), else for something
  it was already queued behind (an event, another stream, the JPEG engines);
- for gaps waiting on the training thread, what that thread ran meanwhile (operators by
  overlapped time; time covered by none of them is Python or waiting for the GIL);
- GPU time per stream, so the input pipeline's own kernels and copies are counted;
- the host's CUDA calls that blocked for 1 ms or more, per thread and name (a library that
  waits on its own events or synchronises the device shows here);
- GPU time per step by kind of kernel (convolution, matrix product, inductor's fused kernels,
  optimizer, other) and the kernels that took most of it (kernels replayed from a CUDA graph
  included).

    python benchmarks/resnet50/trace_gaps.py runs/x/profile/trace.json --out gaps.json
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
SMALLEST_GAP_US = 5.0
LONGEST_CALL_US = 1000.0
KERNEL_KINDS = (  # first match wins; names of cuDNN/CUTLASS kernels vary by version
    ("matrix product", ("triton_tem_",)),  # inductor's templates (max-autotune)
    # before "convolution": inductor names fused kernels after every op they hold
    ("fused pointwise/reduction (inductor)", ("triton_",)),
    ("optimizer", ("multi_tensor", "fused_sgd", "foreach")),
    ("convolution", ("conv", "xmma", "implicit", "dgrad", "wgrad", "nhwc", "nchw", "cudnn")),
    ("matrix product", ("gemm", "cutlass", "sm90_", "sm80_", "nvjet", "mm_")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, marks in KERNEL_KINDS:
        if any(mark in lowered for mark in marks):
            return kind
    return "other"


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def overlap(intervals: list[tuple[float, float, str]], starts: list[float], lo: float, hi: float) -> dict:
    """Microseconds of [lo, hi] covered by each name of ``intervals`` (sorted by start)."""
    covered: dict[str, float] = collections.defaultdict(float)
    for start, end, name in intervals[max(0, bisect.bisect_left(starts, lo) - 200):bisect.bisect_right(starts, hi)]:
        if end > lo and start < hi:
            covered[name] += min(end, hi) - max(start, lo)
    return covered


def analyse(events: list[dict]) -> dict:
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        raise SystemExit("no GPU work in the trace (was it profiled on a GPU?)")
    launches = {e["args"]["correlation"]: e for e in events  # runtime API, and driver API (Triton's launches)
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    # the host's step annotations (Kineto mirrors each on the GPU's timeline as gpu_user_annotation)
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#") and e.get("cat") != "gpu_user_annotation"]
    main_tid = steps[0]["tid"] if steps else collections.Counter(e["tid"] for e in launches.values()).most_common(1)[0][0]
    # top-level operators of the training thread: the outermost cpu_op at each moment
    ops = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                 if e.get("tid") == main_tid and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")
                 and not e["name"].startswith("ProfilerStep#"))
    op_starts = [o[0] for o in ops]

    busy = union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    window = (busy[0][0], busy[-1][1])
    by_start = sorted(gpu, key=lambda e: e["ts"])
    gpu_starts = [e["ts"] for e in by_start]
    kinds: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    main_thread_ops: dict[str, float] = collections.defaultdict(float)
    for (_, gap_start), (gap_end, _) in zip(busy, busy[1:]):
        length = gap_end - gap_start
        if length < SMALLEST_GAP_US:
            kinds["gaps under 5 us"] += length
            continue
        ender = by_start[bisect.bisect_left(gpu_starts, gap_end)]
        launch = launches.get(ender.get("args", {}).get("correlation"))
        if launch is None:
            kind = "work launched outside the trace"
        elif launch["ts"] > gap_start:
            kind = "waiting for a launch by the training thread" if launch["tid"] == main_tid else \
                "waiting for a launch by another thread"
            if launch["tid"] == main_tid:
                covered = overlap(ops, op_starts, gap_start, min(gap_end, launch["ts"]))
                for name, us in covered.items():
                    main_thread_ops[name] += us
                main_thread_ops["(no operator: Python, the GIL)"] += \
                    max(0.0, min(gap_end, launch["ts"]) - gap_start - sum(covered.values()))
        else:
            kind = "queued behind something else"
        kinds[kind] += length
        counts[kind] += 1

    blocking: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["dur"] >= LONGEST_CALL_US:
            thread = "training thread" if e["tid"] == main_tid else f"thread {e['tid']}"
            blocking[f"{thread}: {e['name']}"].append(e["dur"])

    per_stream: dict[str, float] = collections.defaultdict(float)
    for e in gpu:
        per_stream[f"stream {e['tid']}"] += e["dur"]
    by_kind: dict[str, float] = collections.defaultdict(float)
    by_name: dict[str, float] = collections.defaultdict(float)
    for e in gpu:
        by_kind[kind_of(e["name"])] += e["dur"]
        by_name[e["name"][:120]] += e["dur"]
    per_step = 1e3 * max(1, len({e["name"] for e in steps}))  # (microseconds to milliseconds per step)
    span = window[1] - window[0]
    busy_us = sum(b - a for a, b in busy)
    return {
        "steps": len(steps),
        "gpu_window_ms": round(span / 1e3, 3),
        "gpu_busy_share": round(busy_us / span, 4),
        "idle_ms_by_cause": {k: round(v / 1e3, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "gaps_by_cause": dict(counts),
        "training_thread_during_launch_waits_ms": {
            k: round(v / 1e3, 3) for k, v in sorted(main_thread_ops.items(), key=lambda kv: -kv[1])[:15]},
        "blocking_calls": {k: {"count": len(v), "total_ms": round(sum(v) / 1e3, 3), "max_ms": round(max(v) / 1e3, 3)}
                           for k, v in sorted(blocking.items(), key=lambda kv: -sum(kv[1]))},
        "gpu_ms_by_stream": {k: round(v / 1e3, 3) for k, v in sorted(per_stream.items(), key=lambda kv: -kv[1])},
        "gpu_ms_per_step_by_kind": {k: round(v / per_step, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms_per_step": {k: round(v / per_step, 3)
                                    for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:25]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--out")
    args = parser.parse_args()
    result = analyse(load(args.trace))
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
