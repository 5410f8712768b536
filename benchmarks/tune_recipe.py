"""Runs a recipe with several overrides and seeds in one process, on one GPU.

    python benchmarks/tune_recipe.py --recipe cifar10-fast --data DIR --seeds 2 \
        --variant '{}' --variant '{"lr": 1.0}' --out results.json

Prints one line per variant: mean/min accuracy, mean training time. The data set is
decoded once and shared by every run.
"""

import argparse
import json
import statistics
import tempfile
import time

import torch

import gpuaccel
from gpuaccel.train.recipes import load_recipe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--out")
    args = ap.parse_args()
    base = load_recipe(args.recipe)
    t0 = time.perf_counter()
    data = gpuaccel.load_dataset(args.data)
    print(f"data loaded in {time.perf_counter() - t0:.1f} s: {data.describe()}", flush=True)
    rows = []
    for variant in args.variant or ["{}"]:
        overrides = json.loads(variant)
        torch._dynamo.reset()  # each variant's graphs count against Dynamo's recompile limit otherwise
        runs = []
        for seed in range(args.seeds):
            cfg = gpuaccel.TrainConfig.from_dict({**base, "data": args.data, **overrides, "seed": seed,
                                                  "run_dir": tempfile.mkdtemp()})
            runs.append(gpuaccel.Trainer(cfg, dataset=data, quiet=True).fit())
        accs = [r["test_accuracy"] for r in runs]
        secs = [r["train_seconds"] for r in runs]
        row = {"variant": overrides, "accuracy_mean": statistics.mean(accs), "accuracy_min": min(accs),
               "accuracies": accs, "train_seconds_mean": statistics.mean(secs), "train_seconds": secs,
               "warmup_seconds": [r["warmup_seconds"] for r in runs], "device": runs[0]["device_name"],
               "torch": torch.__version__}
        rows.append(row)
        print(f"{json.dumps(overrides):60s} acc mean {100 * row['accuracy_mean']:.2f} min {100 * row['accuracy_min']:.2f}"
              f"  train {row['train_seconds_mean']:.2f} s  warmup {row['warmup_seconds']}", flush=True)
        if args.out:  # after every variant, so a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
