"""Model parallelism and memory savings, measured with real `gpuaccel train` commands.

    python benchmarks/scaling/pipeline_and_memory.py --phase pipeline --out pipeline.json   # 2 GPUs or more
    python benchmarks/scaling/pipeline_and_memory.py --phase memory --out memory.json       # one GPU

pipeline: ResNet-50 on synthetic 224 px images, bf16, eager, global batch 256 per step (--batch):
  one GPU; two GPUs data parallel (128 each); two pipeline stages (1F1B with 4 and 8
  micro-batches, GPipe with 4); the same 2-stage 1F1B run compiled. Throughput is the
  summary's images/s (training time only: warm-up, evaluation and checkpoints excluded).
memory: on one GPU, each pair shows a model and batch that runs out of memory, and the
  option that makes it train:
  ResNet-50, batch 2304                         -> + --activation-checkpointing
  ViT-G/14 (timm, 1.8 B parameters), AdamW, batch 512, with activation checkpointing
                                                -> + --shard --offload cpu
  The peak GPU memory of each run that trains is PyTorch's max_memory_allocated.
"""

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from scaling import synthetic_npz, train  # noqa: E402


def small_npz(path: Path, train_images: int, test_images: int, classes: int = 1000) -> Path:
    if not path.exists():
        rng = np.random.default_rng(0)
        np.savez(path, x_train=rng.integers(0, 256, (train_images, 3, 224, 224), dtype=np.uint8),
                 y_train=rng.integers(0, classes, train_images),
                 x_test=rng.integers(0, 256, (test_images, 3, 224, 224), dtype=np.uint8),
                 y_test=np.arange(test_images) % classes)
    return path


def pipeline_phase(work: Path, batch: int, only: list[str] | None) -> list[dict]:
    data = synthetic_npz(work / "synthetic-224.npz", train=256 * 24, test=1024)
    common = ["--data", f"npz:{data}", "--model", "resnet50", "--epochs", "2", "--lr", "0.1",
              "--eval-batch-size", "256", "--no-monitor"]
    whole, half, piped = ["--batch-size", str(batch)], ["--batch-size", str(batch // 2)], \
        ["--batch-size", str(batch), "--pipeline-stages", "2"]
    runs = {
        "1 GPU": (1, whole),
        "2 GPUs data parallel": (2, half),
        "2 stages 1F1B, 4 micro-batches": (2, [*piped, "--microbatches", "4"]),
        "2 stages 1F1B, 8 micro-batches": (2, [*piped, "--microbatches", "8"]),
        "2 stages GPipe, 4 micro-batches": (2, [*piped, "--microbatches", "4", "--pipeline-schedule", "gpipe"]),
        "2 stages 1F1B, 4 micro-batches, compiled": (2, [*piped, "--microbatches", "4", "--compile"]),
    }
    rows = []
    for name, (gpus, extra) in runs.items():
        if only and name not in only:
            continue
        row = {"name": name, **train(gpus, work / name.replace(" ", "_").replace(",", ""), [*common, *extra])}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
    base = rows[0].get("samples_per_second")
    for row in rows:
        if base and "samples_per_second" in row:
            row["speedup_vs_1_gpu"] = round(row["samples_per_second"] / base, 3)
    return rows


def memory_phase(work: Path) -> list[dict]:
    resnet_data = small_npz(work / "r50.npz", 4608, 256)
    vit_data = small_npz(work / "vit.npz", 1024, 128)
    resnet = ["--data", f"npz:{resnet_data}", "--model", "resnet50", "--batch-size", "2304", "--epochs", "1",
              "--eval-batch-size", "256", "--no-monitor"]
    vit = ["--data", f"npz:{vit_data}", "--model", "timm:vit_gigantic_patch14_224", "--optimizer", "adamw",
           "--lr", "1e-4", "--batch-size", "512", "--epochs", "1", "--eval-batch-size", "128", "--no-monitor",
           "--activation-checkpointing"]
    runs = {
        "resnet50 batch 2304": resnet,
        "resnet50 batch 2304 + activation checkpointing": [*resnet, "--activation-checkpointing"],
        "ViT-G/14 batch 512, activation checkpointing": vit,
        "ViT-G/14 batch 512, activation checkpointing + shard + offload cpu": [*vit, "--shard", "--offload", "cpu"],
    }
    rows = []
    for name, args in runs.items():
        row = {"name": name, **train(None, work / name.replace(" ", "_").replace(",", "").replace("/", ""), args)}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("pipeline", "memory"), required=True)
    ap.add_argument("--work", default="/tmp/pipeline_and_memory")
    ap.add_argument("--batch", type=int, default=256, help="pipeline: images per step (all GPUs together)")
    ap.add_argument("--only", nargs="*", help="pipeline: run only these rows (by name)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = pipeline_phase(work, args.batch, args.only) if args.phase == "pipeline" else memory_phase(work)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count(),
              "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
              "phase": args.phase, "batch": args.batch if args.phase == "pipeline" else None, "runs": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
