"""CIFAR-10 speed, side by side, in one process on one GPU.

(a) the textbook PyTorch way: torchvision's ResNet-18, a CPU DataLoader with PIL
    random-crop/flip transforms (8 workers), batch 128, SGD lr 0.1 momentum 0.9 wd 5e-4;
    fp32, and bf16 autocast + channels_last;
(b) gpuaccel's engine and GPU-resident loader on the same model and hyper-parameters, eager and
    with CUDA graphs;
(c) the recipes cifar10-fast (5 seeds) and cifar10-accurate (3 seeds), and the wall time
    of the whole `gpuaccel train --recipe cifar10-fast` command with warm caches.

    python benchmarks/cifar10_speed/cifar10_speed.py --data /path/to/cifar10 --out cifar10_speed.json

--data is the ImageFolder tree (train/<class>/*.jpg, test/<class>/*.jpg). Needs a CUDA GPU
and torchvision (for the baseline).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import gpuaccel
from gpuaccel.train.recipes import load_recipe

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def torchvision_resnet18(num_classes=10, **_):
    import torchvision

    return torchvision.models.resnet18(num_classes=num_classes)


def textbook_baseline(data_dir: str, epochs: int, bf16: bool) -> dict:
    """(a): what a PyTorch tutorial does. Per-epoch time excludes evaluation."""
    import torchvision
    import torchvision.transforms as T

    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    train = torchvision.datasets.ImageFolder(os.path.join(data_dir, "train"), train_tf)
    test = torchvision.datasets.ImageFolder(os.path.join(data_dir, "test"), test_tf)
    loader = torch.utils.data.DataLoader(train, batch_size=128, shuffle=True, num_workers=8, pin_memory=True,
                                         persistent_workers=True, drop_last=True)
    test_loader = torch.utils.data.DataLoader(test, batch_size=1024, num_workers=8)
    torch.manual_seed(0)
    model = torchvision_resnet18().cuda()
    if bf16:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    epoch_seconds = []
    for _ in range(epochs):
        model.train()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for x, y in loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            if bf16:
                x = x.to(memory_format=torch.channels_last)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
        epoch_seconds.append(time.perf_counter() - start)
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in test_loader:
            correct += (model(x.cuda()).argmax(1).cpu() == y).sum().item()
    return {"epoch_seconds": epoch_seconds, "accuracy": correct / len(test)}


def gpuaccel_run(data, config: dict, model=None) -> dict:
    # one process trains several models: without a reset their graphs together pass Dynamo's
    # recompile limit and later runs fall back to eager (compiled kernels stay cached on disk)
    torch._dynamo.reset()
    cfg = gpuaccel.TrainConfig.from_dict({**config, "run_dir": tempfile.mkdtemp()})
    return gpuaccel.Trainer(cfg, dataset=data, model=model, quiet=True).fit()


def summarise(runs: list[dict]) -> dict:
    acc = [r["metrics"]["accuracy"] for r in runs]
    secs = [r["train_seconds"] for r in runs]
    return {"accuracy_mean": statistics.mean(acc), "accuracy_std": statistics.pstdev(acc), "accuracies": acc,
            "train_seconds_mean": statistics.mean(secs), "train_seconds_std": statistics.pstdev(secs),
            "train_seconds": secs, "epoch_seconds_mean": statistics.mean(s / r["epochs"] for s, r in zip(secs, runs)),
            "warmup_seconds": [r["warmup_seconds"] for r in runs]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--baseline-epochs", type=int, default=3)
    ap.add_argument("--fast-seeds", type=int, default=5)
    ap.add_argument("--accurate-seeds", type=int, default=3)
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv), "rows": {}}
    rows = result["rows"]

    def report(name, row):
        rows[name] = row
        print(name, json.dumps(row), flush=True)
        with open(args.out, "w") as f:  # after every row, so a run cut short keeps what it measured
            json.dump(result, f, indent=2, default=str)

    for bf16 in (False, True):
        name = "a_textbook_" + ("bf16_channels_last" if bf16 else "fp32")
        r = textbook_baseline(args.data, args.baseline_epochs, bf16)
        report(name, {**r, "epoch_seconds_median": statistics.median(r["epoch_seconds"][1:] or r["epoch_seconds"])})

    start = time.perf_counter()
    data = gpuaccel.load_dataset(args.data, decode_device=torch.device("cuda"), cache_dir=tempfile.mkdtemp())
    rows["decode_seconds_gpu_cold_cache"] = time.perf_counter() - start
    same = {"data": args.data, "batch_size": 128, "lr": 0.1, "momentum": 0.9, "nesterov": False,
            "weight_decay": 5e-4, "schedule": "constant", "warmup_epochs": 0, "crop_padding": 4, "flip": "random",
            "epochs": args.baseline_epochs}
    # eager, then with the whole forward and backward captured as CUDA graphs (torch.compile
    # reduce-overhead): at batch 128 this model is bound by per-operation dispatch on the host
    for name, engine in (("b_gpuaccel_same_model_eager", {}),
                         ("b_gpuaccel_same_model", {"compile": True, "compile_mode": "reduce-overhead"})):
        runs = [gpuaccel_run(data, {**same, **engine, "seed": s}, torchvision_resnet18()) for s in range(2)]
        report(name, {**summarise(runs), "overrides": engine})
        for a in ("a_textbook_fp32", "a_textbook_bf16_channels_last"):
            ratio = rows[a]["epoch_seconds_median"] / rows[name]["epoch_seconds_mean"]
            rows[f"ratio_{name}_vs_{a}_per_epoch"] = ratio
            print(f"{name} vs {a}: {ratio:.2f}x per epoch", flush=True)

    for recipe, seeds, extra in (("cifar10-fast", args.fast_seeds, {}),
                                 ("cifar10-fast", 3, {"compile": False}),
                                 ("cifar10-accurate", args.accurate_seeds, {})):
        name = f"c_{recipe}" + ("_eager" if extra else "")
        try:
            runs = [gpuaccel_run(data, {**load_recipe(recipe), "data": args.data, **extra, "seed": s})
                    for s in range(seeds)]
            report(name, {**summarise(runs), "overrides": extra})
        except Exception as exc:  # an experiment's failure is a result, not the end of the benchmark
            report(name, {"error": f"{type(exc).__name__}: {exc}"[:500], "overrides": extra})

    walls = []
    for _ in range(3):  # the run after the one that decodes compiles again (docs/results.md); the third is warm
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "gpuaccel", "train", "--recipe", "cifar10-fast", "--data",
                              args.data, "--json", "--run-dir", tempfile.mkdtemp() + "/run"],
                             capture_output=True, text=True, check=True)
        walls.append({"command_wall_seconds": time.perf_counter() - start, **json.loads(out.stdout)})
    report("c_cli_cifar10_fast_wall", {"cold_then_warm": walls})


if __name__ == "__main__":
    main()
