"""Runs a recipe with several overrides and seeds in one process, on one GPU.

    python benchmarks/recipes/tune_recipe.py --recipe cifar10-fast --data DIR --seeds 2 \
        --variant '{}' --variant '{"lr": 1.0}' --out results.json

A variant's "inductor" key sets Inductor's options for its runs (a probe of kernels that the
recipe cannot choose), e.g. ``--variant '{"inductor": {"coordinate_descent_tuning": true}}'``.

Prints one line per variant: the task's main metric (accuracy, RMSE, ...) per seed and its
mean, and the mean training time. Image data is decoded
once and shared by every run; other data (text, recordings) is read from gpuaccel's cache.
"""

import argparse
import json
import statistics
import tempfile
import time

import torch

import gpuaccel
from gpuaccel.data import NON_IMAGE_KINDS, parse_spec
from gpuaccel.train.recipes import load_recipe


def run_seeds(base: dict, data_spec: str, dataset, overrides: dict, seeds) -> list[dict]:
    """The recipe ``base`` with ``overrides`` trained once per seed in this process, on
    ``dataset`` when given (decoded images, shared by the runs); each run's summary.
    ``overrides["inductor"]``, if any, patches Inductor's options for these runs."""
    import torch._inductor.config as inductor_config

    overrides = dict(overrides)
    inductor = overrides.pop("inductor", {})
    torch._dynamo.reset()  # each variant's graphs count against Dynamo's recompile limit otherwise
    with inductor_config.patch(inductor):
        return [gpuaccel.Trainer(gpuaccel.TrainConfig.from_dict({**base, "data": data_spec, **overrides, "seed": seed,
                                                                 "run_dir": tempfile.mkdtemp()}),
                                 dataset=dataset, quiet=True).fit()
                for seed in seeds]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--out")
    args = ap.parse_args()
    base = load_recipe(args.recipe)
    t0 = time.perf_counter()
    data = None
    if parse_spec(args.data)[0] not in NON_IMAGE_KINDS:
        data = gpuaccel.load_dataset(args.data)
        print(f"data loaded in {time.perf_counter() - t0:.1f} s: {data.describe()}", flush=True)
    rows = []
    for variant in args.variant or ["{}"]:
        overrides = json.loads(variant)
        runs = run_seeds(base, args.data, data, overrides, range(args.first_seed, args.first_seed + args.seeds))
        metric = runs[0].get("main_metric") or "accuracy"
        values = [r["metrics"][metric] for r in runs]
        secs = [r["train_seconds"] for r in runs]
        row = {"variant": overrides, "metric": metric, "mean": statistics.mean(values), "values": values,
               "train_seconds_mean": statistics.mean(secs), "train_seconds": secs,
               "warmup_seconds": [r["warmup_seconds"] for r in runs], "device": runs[0]["device_name"],
               "torch": torch.__version__}
        rows.append(row)
        print(f"{json.dumps(overrides):60s} {metric} mean {row['mean']:.4f} ({', '.join(f'{v:.4f}' for v in values)})"
              f"  train {row['train_seconds_mean']:.2f} s  warmup {row['warmup_seconds']}", flush=True)
        if args.out:  # after every variant, so a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
