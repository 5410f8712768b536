"""Runs a recipe with several overrides and seeds in one process, on one GPU.

    python benchmarks/recipes/tune_recipe.py --recipe cifar10-fast --data DIR --seeds 2 \
        --variant '{}' --variant '{"lr": 1.0}' --out results.json

A variant's "inductor" key sets Inductor's options for its runs (a probe of kernels that the
recipe cannot choose), e.g. ``--variant '{"inductor": {"coordinate_descent_tuning": true}}'``.
Its "batch_norm_groups" key N has every batch norm normalise each of N equal slices of a batch
on its own, as N GPUs with a share each would: one GPU then trains as N do (the gradient of the
mean loss is the mean of the slices' gradients, as data parallelism's all-reduce makes it), so a
global batch for N GPUs can be tuned on one, e.g.
``--variant '{"batch_norm_groups": 4, "batch_size": 2048, "epochs": 8}'``. The running statistics
follow the first slice's, as each process keeps its own; with ``"batch_norm_running": "mean"``
they follow the slices' mean. A variant's "model_args" change the recipe's key by key, as
``--model-args`` does over a recipe.

Prints one line per variant: the task's main metric (accuracy, RMSE, ...) per seed and its
mean, and the mean training time. Image data is decoded
once and shared by every run; other data (text, recordings) is read from gpuaccel's cache.
"""

import argparse
import contextlib
import json
import statistics
import tempfile
import time

import torch

import gpuaccel
from gpuaccel.data import parse_spec
from gpuaccel.data.kinds import kind_named
from gpuaccel.train.recipes import load_recipe, over_recipe


@contextlib.contextmanager
def batch_norm_groups(groups: int, running: str = "first"):
    """Training-mode batch norms (4-D inputs) normalise each of ``groups`` equal slices of the batch
    with that slice's statistics, as on ``groups`` GPUs without synchronised batch norm. The running
    statistics move towards the first slice's (``running="first"``: as each process keeps its own)
    or towards the slices' mean (``"mean"``: as if the processes averaged theirs)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    original = _BatchNorm.forward

    def forward(self, x):
        if not self.training or x.dim() != 4 or groups == 1:
            return original(self, x)
        if x.shape[0] % groups:
            raise ValueError(f"a batch of {x.shape[0]} does not split into {groups} equal slices")
        n = x.shape[0] // groups
        slices = x.float().reshape(groups, n, *x.shape[1:])
        mean = slices.mean(dim=(1, 3, 4), keepdim=True)
        var = slices.var(dim=(1, 3, 4), unbiased=False, keepdim=True)
        y = (slices - mean) * torch.rsqrt(var + self.eps)
        if self.affine:
            y = y * self.weight.view(1, 1, -1, 1, 1) + self.bias.view(1, 1, -1, 1, 1)
        if self.track_running_stats:
            count = n * x.shape[2] * x.shape[3]
            batch_mean, batch_var = (mean[0], var[0]) if running == "first" else (mean.mean(0), var.mean(0))
            with torch.no_grad():
                self.running_mean.lerp_(batch_mean.flatten(), self.momentum)
                self.running_var.lerp_(batch_var.flatten() * count / (count - 1), self.momentum)
        return y.reshape(x.shape).to(x.dtype)

    _BatchNorm.forward = forward
    try:
        yield
    finally:
        _BatchNorm.forward = original


def run_seeds(base: dict, data_spec: str, dataset, overrides: dict, seeds) -> list[dict]:
    """The recipe ``base`` with ``overrides`` trained once per seed in this process, on
    ``dataset`` when given (decoded images, shared by the runs); each run's summary.
    ``overrides["inductor"]``, if any, patches Inductor's options for these runs;
    ``overrides["batch_norm_groups"]`` splits the batch norms' batches (``batch_norm_groups``)."""
    import torch._inductor.config as inductor_config

    overrides = dict(overrides)
    inductor = overrides.pop("inductor", {})
    groups = overrides.pop("batch_norm_groups", 1)
    running = overrides.pop("batch_norm_running", "first")
    torch._dynamo.reset()  # each variant's graphs count against Dynamo's recompile limit otherwise
    with inductor_config.patch(inductor), batch_norm_groups(groups, running):
        settings = [over_recipe(base, {"data": data_spec, **overrides, "seed": seed, "run_dir": tempfile.mkdtemp()})
                    for seed in seeds]
        return [gpuaccel.Trainer(gpuaccel.TrainConfig.from_dict(s), dataset=dataset, quiet=True).fit()
                for s in settings]


def _curve(summary: dict) -> list[dict]:
    """A run's evaluations (metrics.jsonl): step, training seconds and the metrics at each."""
    from pathlib import Path

    path = Path(summary["run_dir"]) / "metrics.jsonl"
    if not path.exists():
        return []
    keep = ("step", "epoch", "elapsed", "loss", summary.get("main_metric") or "accuracy")
    return [{k: r[k] for k in keep if k in r} for r in map(json.loads, path.read_text().splitlines()) if r]


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
    if kind_named(parse_spec(args.data)[0]).name == "images":
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
               "best": [r["best_metrics"].get(metric) for r in runs], "curves": [_curve(r) for r in runs],
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
