"""Where a training step's GPU time goes: the kernels of a torch.profiler trace (``gpuaccel train
... --profile``'s ``profile/trace.json``, gzipped or not) summed per step, by kind and by kernel.

    python benchmarks/gpt2_speed/kernel_summary.py RUN/profile/trace.json --out kernels.json

Steps are told apart by the optimizer: each step starts with one burst of AdamW's fused kernels
(``--step-marker``, a part of a kernel's name; the previous step's update). Only whole steps count,
from the first burst to the last; what the GPU ran before and after is left out.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from datetime import datetime, timezone

KINDS = (  # the first whose words a kernel's name holds
    ("matrix products", ("nvjet", "gemm", "cutlass", "splitKreduce", "sm90_xmma")),
    ("attention", ("sdpa", "flash", "cudnn")),
    ("optimizer", ("multi_tensor_apply",)),
    ("normalisation", ("rms_norm", "layer_norm")),
    ("loss", ("softmax", "nll_loss", "cross_entropy", "loss_and_gradient", "_loss_kernel", "fp8_gradient")),
    ("activation", ("gelu", "relu")),
)


def kind(name: str) -> str:
    return next((k for k, words in KINDS if any(w in name for w in words)), "other")


def summarise(path: str, marker: str, top: int = 30) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    on_gpu = ("kernel", "gpu_memset", "gpu_memcpy")
    kernels = sorted((e for e in events if e.get("cat") in on_gpu and e.get("ph") == "X"), key=lambda e: e["ts"])
    marked = [i for i, e in enumerate(kernels) if marker in e["name"]]
    starts = [b for a, b in zip([-100] + marked, marked) if b - a > 20]  # each burst's first kernel
    steps = len(starts) - 1
    if steps < 1:
        sys.exit(f"kernel_summary: fewer than two bursts of kernels named like {marker!r} in {path}; name a kernel "
                 f"that runs once at each step's end with --step-marker (e.g. a part of the optimizer's kernel's name)")
    kernels = kernels[starts[0]:starts[-1]]
    by_kind, by_name, count = collections.Counter(), collections.Counter(), collections.Counter()
    for e in kernels:
        by_kind[kind(e["name"])] += e["dur"]
        by_name[e["name"][:120]] += e["dur"]
        count[e["name"][:120]] += 1
    per_step = 1e-3 / steps  # (microseconds in the trace, milliseconds per step here)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    return {"trace": path.rsplit("/", 1)[-1], "steps": steps, "ms_per_step": round(span * per_step, 3),
            "kernel_ms_per_step": round(sum(by_kind.values()) * per_step, 3),
            "by_kind_ms_per_step": {k: round(v * per_step, 3) for k, v in by_kind.most_common()},
            "kernels": [{"name": n, "ms_per_step": round(v * per_step, 3), "calls_per_step": round(count[n] / steps, 2)}
                        for n, v in by_name.most_common(top)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", help="torch.profiler Chrome traces (.json or .json.gz)")
    p.add_argument("--step-marker", default="FusedOptimizer", help="a part of the name of the kernel that ends a step")
    p.add_argument("--top", type=int, default=30, help="how many kernels to list, the longest first")
    p.add_argument("--traced-by", help="the command that wrote the traces, kept in the JSON")
    p.add_argument("--out", help="write the summary as JSON here")
    args = p.parse_args()
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "traced_by": args.traced_by,
              "summaries": [summarise(t, args.step_marker, args.top) for t in args.traces]}
    for s in result["summaries"]:
        print(s["trace"], f"{s['steps']} steps of {s['ms_per_step']} ms, {s['kernel_ms_per_step']} ms of kernels each:",
              ", ".join(f"{k} {v}" for k, v in s["by_kind_ms_per_step"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
