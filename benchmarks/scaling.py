"""Data-parallel scaling on the GPUs of one machine: 1, 2, 4 ... processes through
`gpuaccel train --gpus N` (torch.distributed.run, DDP over NCCL), in one script.

    python benchmarks/scaling.py --data /tmp/data/cifar10 --gpus 1 2 --out scaling.json

Workloads (weak scaling: the batch per GPU stays fixed, so N GPUs take N times the
images per step):
  resnet50-224   ResNet-50 on synthetic 224 px images (an .npz made here), bf16, batch 128/GPU
  resnet18-cifar ResNet-18 on the CIFAR-10 folder, bf16, batch 512/GPU, eager
  resnet18-cifar-b1024   the same with batch 1024/GPU (and twice the learning rate)
  resnet18-cifar-graphs  batch 512/GPU with CUDA graphs (compile mode reduce-overhead)
  cifar10-fast   the fast CIFAR-10 recipe with its global batch kept (1024 / N per GPU), to see
                 whether it reaches its accuracy sooner
Throughput is the summary's images/s: images over
training time (warm-up, evaluation and checkpoints excluded). Efficiency on N GPUs is
throughput(N) / (N x throughput(1)). The ResNet-18 runs train 10 epochs, so that even 4 GPUs
train for seconds, not one, and evaluate once, at the end, to keep the runs short.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch


def synthetic_npz(path: Path, train: int, test: int, size: int = 224) -> Path:
    if not path.exists():
        rng = np.random.default_rng(0)
        np.savez(path, x_train=rng.integers(0, 256, (train, 3, size, size), dtype=np.uint8),
                 y_train=rng.integers(0, 1000, train), x_test=rng.integers(0, 256, (test, 3, size, size),
                                                                            dtype=np.uint8),
                 y_test=np.arange(test) % 1000)
    return path


def train(gpus: int | None, run_dir: Path, args: list[str]) -> dict:
    """One `gpuaccel train` command (through the launcher with `gpus`, else one plain process)."""
    launch = ["--gpus", str(gpus)] if gpus else []
    cmd = [sys.executable, "-m", "gpuaccel", "train", *launch, "--run-dir", str(run_dir), "--quiet", *args]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("gpuaccel: error:")]
        return {"gpus": gpus or 1, "error": errors[-1] if errors else (done.stdout + done.stderr)[-1500:],
                "exit_status": done.returncode, "command": " ".join(cmd)}
    s = json.loads((run_dir / "summary.json").read_text())
    return {"gpus": gpus or 1, "images_per_second": s["images_per_second"], "train_seconds": s["train_seconds"],
            "test_accuracy": s["test_accuracy"], "global_batch_size": s["global_batch_size"],
            "epochs": s["epochs"], "peak_gpu_memory_gib": s.get("peak_gpu_memory_gib"),
            "parameters": s["parameters"], "command_wall_seconds": round(wall, 1), "command": " ".join(cmd)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="the CIFAR-10 folder")
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--work", default="/tmp/scaling")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    synth = None

    def resnet18_cifar(batch: int, lr: float) -> list[str]:
        return ["--data", args.data, "--model", "resnet18", "--batch-size", str(batch), "--epochs", "10",
                "--eval-every", "1000000", "--lr", str(lr), "--crop-padding", "4", "--flip", "random"]

    workloads = {
        "resnet50-224": lambda n: ["--data", f"npz:{synth}", "--model", "resnet50", "--batch-size", "128",
                                   "--epochs", "3", "--lr", "0.1", "--eval-batch-size", "256"],
        "resnet18-cifar": lambda n: resnet18_cifar(512, 0.2),
        "resnet18-cifar-b1024": lambda n: resnet18_cifar(1024, 0.4),
        "resnet18-cifar-graphs": lambda n: resnet18_cifar(512, 0.2) + ["--compile", "--compile-mode",
                                                                       "reduce-overhead"],
        "cifar10-fast": lambda n: ["--data", args.data, "--recipe", "cifar10-fast", "--batch-size", str(1024 // n)],
    }
    results = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count(), "workloads": {}}
    for name, make_args in workloads.items():
        if args.only and name not in args.only:
            continue
        if name == "resnet50-224" and synth is None:
            synth = synthetic_npz(work / "synthetic-224.npz", train=12288, test=1024)
        rows = []
        for n in args.gpus:
            row = train(n, work / f"{name}-{n}", make_args(n))
            rows.append(row)
            print(name, json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
        base = next((r["images_per_second"] for r in rows if r.get("gpus") == 1), None)
        for r in rows:
            if base and "images_per_second" in r:
                r["efficiency"] = r["images_per_second"] / (r["gpus"] * base)
        results["workloads"][name] = rows
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
