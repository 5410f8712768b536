"""ResNet-50 training steps on one in-memory batch at 224 px (bf16 autocast, channels_last,
torch.compile, fused SGD), under variants of inductor's settings and the batch size, and
where the GPU time of the default variant goes, by kind of kernel.

Each variant runs in a child process of its own (inductor's settings are global, and a
variant whose compilation outlasts ``--timeout`` is recorded as such, not waited for).

    python benchmarks/resnet50/resnet50_step.py --out resnet50_step.json
    python benchmarks/resnet50/resnet50_step.py --variants default conv1x1-mm --profile
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from step_time import training_step
from trace_gaps import kind_of

# name -> (inductor settings, batch size)
VARIANTS = {
    "default": ({}, 256),
    "conv1x1-mm": ({"conv_1x1_as_mm": True}, 256),
    "coordinate-descent": ({"coordinate_descent_tuning": True}, 256),
    "conv1x1-mm+coordinate-descent": ({"conv_1x1_as_mm": True, "coordinate_descent_tuning": True}, 256),
    "batch-384": ({}, 384),
    "batch-512": ({}, 512),
    "conv1x1-mm+autotune-gemm": ({"conv_1x1_as_mm": True, "max_autotune_gemm": True}, 256),
    "max-autotune": ({"max_autotune": True}, 256),
}

def build(batch: int, classes: int = 100):
    try:
        import torchvision

        model = torchvision.models.resnet50(num_classes=classes)
        source = "torchvision"
    except ImportError:  # the same architecture
        import gpuaccel

        model = gpuaccel.create_model("resnet50", num_classes=classes, image_size=224)
        source = "gpuaccel"
    model = model.cuda().to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5, fused=True)
    compiled = torch.compile(model)
    x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (batch,), device="cuda")
    return training_step(compiled, optimizer, x, y), source


def run_variant(name: str, profile: bool) -> dict:
    from gpuaccel.bench.timing import cuda_times_ms

    settings, batch = VARIANTS[name]
    import torch._inductor.config as inductor_config

    for key, value in settings.items():
        setattr(inductor_config, key, value)
    torch.backends.cudnn.benchmark = True
    start = time.perf_counter()
    step, source = build(batch)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    compile_seconds = time.perf_counter() - start
    steps = 10
    times = cuda_times_ms(lambda: [step() for _ in range(steps)], repeats=7, warmup=2)
    rates = [steps * batch / (t / 1000) for t in times]
    result = {"variant": name, "inductor": settings, "batch_size": batch, "model": source,
              "images_per_second": round(statistics.median(rates), 1), "min": round(min(rates), 1),
              "max": round(max(rates), 1), "ms_per_step": round(statistics.median(times) / steps, 3),
              "compile_seconds": round(compile_seconds, 1),
              "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    if profile:
        result["gpu_time_by_kind"] = gpu_time_by_kind(step)
    return result


def gpu_time_by_kind(step, steps: int = 5) -> dict:
    """GPU milliseconds per step by kind of kernel, and the 12 costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us and event.key:
            per_kernel[event.key] = per_kernel.get(event.key, 0.0) + device_us
    by_kind: dict[str, float] = {}
    for name, us in per_kernel.items():
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + us / 1000 / steps
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    return {"ms_per_step": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "total_ms_per_step": round(sum(by_kind.values()), 3),
            "top_kernels": [{"name": n[:120], "kind": kind_of(n), "ms_per_step": round(us / 1000 / steps, 3)}
                            for n, us in top]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--profile", action="store_true", help="also break the first variant's GPU time down")
    ap.add_argument("--timeout", type=float, default=240, help="seconds one variant may take, compilation included")
    ap.add_argument("--out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_variant(args.child, args.profile)))
        return
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "variants": []}
    for number, name in enumerate(args.variants):
        command = [sys.executable, __file__, "--child", name] + (["--profile"] if args.profile and number == 0 else [])
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=os.environ)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            row = json.loads(lines[-1]) if done.returncode == 0 and lines else \
                {"variant": name, "error": (done.stderr or done.stdout).strip().splitlines()[-3:]}
        except subprocess.TimeoutExpired:
            row = {"variant": name, "error": f"did not finish in {args.timeout:.0f} s (compilation included)"}
        results["variants"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "gpu_time_by_kind"}), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    reference = next((r for r in results["variants"] if r.get("variant") == "default" and "images_per_second" in r), None)
    if reference:
        for row in results["variants"]:
            if "images_per_second" in row:
                row["vs_default"] = round(row["images_per_second"] / reference["images_per_second"], 3)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
