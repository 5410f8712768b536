"""Repeatability on a GPU: two runs from one seed, and what ``--deterministic`` costs.

    python benchmarks/determinism/determinism.py --parts repeat cost --cifar10 /tmp/data/cifar10 --out determinism.json

Parts:
  repeat  ``gpuaccel train --data digits --model lenet5 --batch-size 8 --epochs 3`` twice per setting
          (precision auto; fp32; fp32 with ``--loader cpu``) and the largest difference between
          the two runs' final weights
  cost    ResNet-18 on the CIFAR-10 folder for 4 epochs (bf16, batch 512), with and without
          ``--deterministic``, eager and compiled: images per second and accuracy of each
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch


def train(run_dir: Path, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "gpuaccel", "train", *args, "--run-dir", str(run_dir), "--json",
                           "--quiet", "--no-monitor"], capture_output=True, text=True, check=True)
    return json.loads(done.stdout[done.stdout.index("{"):])


def final_weights(run_dir: Path) -> dict:
    from gpuaccel.train import checkpoint
    return checkpoint.load(str(run_dir / "model.pt"))["model"]


def repeat(work: Path) -> dict:
    settings = {"auto": [], "fp32": ["--precision", "fp32"], "fp32_loader_cpu": ["--precision", "fp32", "--loader", "cpu"]}
    out = {}
    for name, extra in settings.items():
        common = ["--data", "digits", "--model", "lenet5", "--batch-size", "8", "--epochs", "3", *extra]
        first, second = work / f"{name}-a", work / f"{name}-b"
        train(first, *common)
        train(second, *common)
        a, b = final_weights(first), final_weights(second)
        out[name] = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        print(f"{name}: largest weight difference between two runs {out[name]:.3g}", flush=True)
    return out


def cost(work: Path, cifar10: str) -> dict:
    out = {}
    for deterministic in (False, True):
        for compiled in (False, True):
            name = ("deterministic" if deterministic else "default") + ("_compiled" if compiled else "")
            args = ["--data", cifar10, "--model", "resnet18", "--epochs", "4", "--batch-size", "512", "--lr", "0.2",
                    "--crop-padding", "4", "--flip", "random", "--label-smoothing", "0.1"]
            args += ["--deterministic"] * deterministic + ["--compile"] * compiled
            summary = train(work / name, *args)
            out[name] = {"samples_per_second": summary["samples_per_second"],
                         "train_seconds": summary["train_seconds"], "metrics": summary["metrics"]}
            print(name, out[name], flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="+", default=["repeat", "cost"], choices=["repeat", "cost"])
    ap.add_argument("--cifar10", help="the CIFAR-10 JPEG folder (cost)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results = {"meta": {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                        "torch": torch.__version__, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "command": " ".join(sys.argv)}}
    with tempfile.TemporaryDirectory() as tmp:
        if "repeat" in args.parts:
            results["repeat"] = repeat(Path(tmp))
        if "cost" in args.parts:
            results["cost"] = cost(Path(tmp), args.cifar10)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
