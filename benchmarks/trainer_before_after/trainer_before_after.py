"""A change must not move the Trainer's speed: two source trees of gpuaccel (before and after)
measured alternately on one GPU in one process tree, each in its own subprocess.

    python benchmarks/trainer_before_after/trainer_before_after.py --old /tmp/old/src --new src --parts cifar10 shakespeare resnet50 \\
        --cifar10 /tmp/cifar10 --text tinyshakespeare.txt --work /tmp/redesign --out results.json

Parts:
  cifar10   ``gpuaccel train --recipe cifar10-fast`` for ``--seeds`` seeds, old and new
            alternating per seed: training time (first step to last, evaluations excluded) and
            test accuracy from each run's summary
  cifar10-host
            the same with ``--loader cpu``: the images augmented by worker processes on the host,
            copied ahead and normalised on the GPU
  shakespeare
            ``gpuaccel train --recipe shakespeare-char`` (the whole step as one CUDA graph) for
            ``--seeds`` seeds: training time, tokens per second, time to validation loss 1.47
  resnet50  ResNet-50, 224 px, bf16, torch.compile (mode default): the Trainer's training step
            on one fixed in-memory batch of 256, timed with CUDA events (10 steps x 6 repeats
            after the Trainer's warm-up), old and new alternating ``--repeats`` times
  resnet50-graph
            the same with --compile-mode reduce-overhead: the whole step as one CUDA graph
  resnet50-eager
            the same without compiling (eager kernels, the host launches each one)
  scenes-detect
            ``gpuaccel train --recipe scenes-detect`` on a digit-scenes folder (``--scenes``) for
            ``--seeds`` seeds: training time and the held-out metrics
  sst2, multi30k
            ``gpuaccel train --recipe sst2`` (``--sst2``: a folder with train.tsv and dev.tsv) and
            ``--recipe multi30k`` (``--multi30k``: the Multi30k folder) for ``--seeds`` seeds:
            training time, samples per second and the held-out metrics
  ports     benchmarks/porting's ports (``--port-scripts``, variants port and capture) with each
            tree's gpuaccel, old and new alternating over ``--repeats`` rounds: samples per second
            (``--examples``: a pytorch/examples checkout; ``--mnist``, and ``--text`` split 80/10/10 by
            lines for word_language_model)
  stream    ``gpuaccel train --loader stream`` on a synthetic JPEG folder made by
            imagenet_throughput.py's generator (``--stream-cpu-decode 0``: nvJPEG decodes every
            image): images per second over the training time, old and new alternating

Each number is a ratio within this run: new / old on the same machine, minutes apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent



def accuracy(summary: dict) -> float | None:
    """The held-out accuracy of a summary of either age (``metrics`` now, ``test_accuracy`` before)."""
    return summary.get("metrics", {}).get("accuracy", summary.get("test_accuracy"))


def rate(summary: dict) -> float:
    return summary.get("samples_per_second", summary.get("images_per_second"))

def run_gpuaccel(src: str, args: list[str], env_extra: dict | None = None, timeout: int = 400) -> dict:
    """``python -m gpuaccel ARGS --json`` with ``src`` first on the path; its JSON summary."""
    env = {**os.environ, "PYTHONPATH": src, **(env_extra or {})}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gpuaccel", *args, "--json"], capture_output=True, text=True,
                          env=env, timeout=timeout)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-1500:], "args": args}
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    summary["command_seconds"] = round(wall, 2)
    return summary


def recipe_runs(trees: dict, recipe: str, data: str, seeds: int, work: Path, fields, summarised,
                extra: tuple = ()) -> dict:
    """``gpuaccel train --recipe RECIPE [EXTRA]`` for seeds 1..``seeds``, the trees alternating who goes
    first; ``fields(summary)`` picks each run's row, ``summarised`` the keys whose medians are compared."""
    rows = {name: [] for name in trees}
    # one run first that is not counted: the first command on a machine pays one-time costs (the data
    # decoded into the cache, CUDA's lazily loaded modules, the compile caches) that would fall on one tree
    subprocess.run(["rm", "-rf", str(work / f"{recipe}-warm-up")], check=False)
    first = run_gpuaccel(trees["new"], ["train", "--recipe", recipe, "--data", data, "--seed", "0", "--run-dir",
                                        str(work / f"{recipe}-warm-up"), "--quiet", *extra], timeout=500)
    print(recipe, "warm-up run (not counted)", first.get("train_seconds", first.get("error")), flush=True)
    for seed in range(1, seeds + 1):
        for name in (list(trees) if seed % 2 else list(trees)[::-1]):
            run_dir = work / f"{recipe}-{name}-{seed}"
            subprocess.run(["rm", "-rf", str(run_dir)], check=False)
            s = run_gpuaccel(trees[name], ["train", "--recipe", recipe, "--data", data, "--seed", str(seed),
                                           "--run-dir", str(run_dir), "--quiet", *extra], timeout=500)
            row = {"seed": seed, **({"error": s["error"]} if "error" in s else
                                    {**fields(s), "warmup_seconds": s["warmup_seconds"], "step_graph": s.get("step_graph")})}
            rows[name].append(row)
            print(recipe, name, row, flush=True)
    return {"runs": rows, "summary": {name: _stats(rows[name], summarised) for name in rows}}


def cifar10(trees: dict, data: str, seeds: int, work: Path, extra: tuple = ()) -> dict:
    return recipe_runs(trees, "cifar10-fast", data, seeds, work, lambda s: {
        "train_seconds": s["train_seconds"], "test_accuracy": accuracy(s), "setup_seconds": s["setup_seconds"],
        "wall_seconds": s["wall_seconds"], "command_seconds": s["command_seconds"]},
        ("train_seconds", "test_accuracy"), extra)


def shakespeare(trees: dict, text: str, seeds: int, work: Path) -> dict:
    return recipe_runs(trees, "shakespeare-char", text, seeds, work, lambda s: {
        "train_seconds": s["train_seconds"], "tokens_per_second": s["tokens_per_second"],
        "time_to_target": s["time_to_target"], "val_loss": s["metrics"].get("loss")},
        ("train_seconds", "tokens_per_second", "time_to_target", "val_loss"))


def scenes_detect(trees: dict, data: str, seeds: int, work: Path) -> dict:
    return recipe_runs(trees, "scenes-detect", data, seeds, work,
                       lambda s: {"train_seconds": s["train_seconds"], "metrics": s.get("metrics")}, ("train_seconds",))


def recipe(trees: dict, name: str, data: str, seeds: int, work: Path) -> dict:
    return recipe_runs(trees, name, data, seeds, work, lambda s: {
        "train_seconds": s["train_seconds"], "samples_per_second": rate(s), "metrics": s.get("metrics")},
        ("train_seconds", "samples_per_second"))


def ports(trees: dict, args, work: Path) -> dict:
    """run_ports.py once per tree and round (old and new alternating), each with that tree's gpuaccel."""
    text = work / "shakespeare-words"
    if args.text and not text.exists():  # word_language_model's layout: train/valid/test.txt
        lines = Path(args.text).read_text().splitlines(keepends=True)
        text.mkdir(parents=True)
        cut1, cut2 = int(0.8 * len(lines)), int(0.9 * len(lines))
        for name, part in (("train", lines[:cut1]), ("valid", lines[cut1:cut2]), ("test", lines[cut2:])):
            (text / f"{name}.txt").write_text("".join(part))
    rows = {name: [] for name in trees}
    for r in range(args.repeats):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            out = work / f"ports-{name}-{r}.json"
            subprocess.run([sys.executable, str(HERE.parent / "porting" / "run_ports.py"), "--examples",
                            args.examples, "--mnist", args.mnist or "", "--text", str(text), "--scripts",
                            *args.port_scripts, "--variants", "port", "capture", "--repeats", "1", "--src",
                            trees[name], "--out", str(out)], timeout=900, check=False)
            runs = json.loads(out.read_text())["runs"] if out.exists() else []
            for run in runs:
                row = {"round": r, "script": run["script"], "variant": run["variant"],
                       **({"error": run["error"]} if "error" in run else
                          {"samples_per_second": run.get("samples_per_second")})}
                rows[name].append(row)
                print("ports", name, row, flush=True)
    summary = {}
    for name in trees:
        for row in rows[name]:
            if "samples_per_second" in row:
                summary.setdefault(f"{row['script']}/{row['variant']}", {}).setdefault(name, []).append(
                    row["samples_per_second"])
    return {"runs": rows, "summary": {key: {name: {"median": statistics.median(v), "values": v}
                                            for name, v in per.items()} for key, per in summary.items()}}


def _stats(rows: list[dict], keys) -> dict:
    out = {}
    for key in keys:
        values = [r[key] for r in rows if r.get(key) is not None]  # (a run that missed its target has none)
        if values:
            out[key] = {"median": statistics.median(values), "mean": statistics.fmean(values),
                        "min": min(values), "max": max(values), "n": len(values)}
    return out


RESNET50_CHILD = r"""
import json, statistics, sys, time
import numpy as np, torch
from gpuaccel.bench.timing import cuda_times_ms
from gpuaccel.data.dataset import ImageDataset
from gpuaccel.train import TrainConfig, Trainer
B, classes = 256, 100
rng = np.random.default_rng(0)
fake = ImageDataset("synthetic", rng.integers(0, 256, (B, 3, 224, 224), dtype=np.uint8), np.arange(B) % classes,
                    rng.integers(0, 256, (16, 3, 224, 224), dtype=np.uint8), np.arange(16) % classes,
                    [str(c) for c in range(classes)])
eager = sys.argv[1] == "eager"
config = TrainConfig(data="synthetic", model="resnet50", precision="bf16", compile=not eager,
                     compile_mode="default" if eager else sys.argv[1],
                     batch_size=B, lr=0.1, weight_decay=5e-5, monitor=False)
start = time.perf_counter()
trainer = Trainer(config, dataset=fake, quiet=True)
x = torch.randn(B, 3, 224, 224, device="cuda").to(trainer.precision.input_dtype).contiguous(memory_format=torch.channels_last)
y = torch.randint(0, classes, (B,), device="cuda")
trainer.warm_up(evaluate=False)  # (compiles; with reduce-overhead records the step graph)
for _ in range(3):
    trainer.train_step(x, y)
torch.cuda.synchronize()
compile_seconds = time.perf_counter() - start
steps = 10
times = cuda_times_ms(lambda: [trainer.train_step(x, y) for _ in range(steps)], repeats=6, warmup=2)
rates = [steps * B / (t / 1000) for t in times]
print(json.dumps({"images_per_second": statistics.median(rates),
                  "rates": rates, "compile_seconds": compile_seconds}))
"""


def resnet50(trees: dict, repeats: int, mode: str = "default") -> dict:
    rows = {name: [] for name in trees}
    for r in range(repeats):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for name in order:
            env = {**os.environ, "PYTHONPATH": trees[name]}
            done = subprocess.run([sys.executable, "-c", RESNET50_CHILD, mode],
                                  capture_output=True, text=True, env=env, timeout=500)
            if done.returncode != 0:
                row = {"error": (done.stdout + done.stderr)[-1500:]}
            else:
                row = json.loads(done.stdout.strip().splitlines()[-1])
            rows[name].append(row)
            print("resnet50", mode, name, row, flush=True)
    return {"runs": rows, "summary": {name: _stats(rows[name], ("images_per_second",)) for name in rows}}


def stream(trees: dict, work: Path, repeats: int, epochs: int, cpu_decode: float | None = None) -> dict:
    folder = work / "imagenet" / "folder"
    if not folder.exists():
        subprocess.run([sys.executable, str(HERE.parent / "resnet50" / "imagenet_throughput.py"), "--work", str(work / "imagenet"),
                        "--phases", "generate", "--images", "12800", "--val-images", "512", "--classes", "100",
                        "--out", str(work / "generate.json")], check=True, timeout=400)
    rows = {name: [] for name in trees}
    for r in range(repeats):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for name in order:
            run_dir = work / f"stream-{name}-{r}"
            subprocess.run(["rm", "-rf", str(run_dir)])
            s = run_gpuaccel(trees[name], [
                "train", "--data", str(folder), "--loader", "stream", "--model", "resnet50", "--image-size", "224",
                "--precision", "bf16", "--compile", "--batch-size", "256", "--eval-batch-size", "256",
                "--epochs", str(epochs), "--lr", "0.1", "--run-dir", str(run_dir), "--quiet",
                *(() if cpu_decode is None else ("--cpu-decode", str(cpu_decode)))], timeout=500)
            row = {"error": s["error"]} if "error" in s else {
                "images_per_second": rate(s), "train_seconds": s["train_seconds"], "accuracy": accuracy(s),
                "warmup_seconds": s["warmup_seconds"], "jpeg_decoder": s.get("jpeg_decoder")}
            rows[name].append(row)
            print("stream", name, row, flush=True)
    return {"runs": rows, "summary": {name: _stats(rows[name], ("images_per_second",)) for name in rows}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="the src/ directory of the code before")
    ap.add_argument("--new", required=True, help="the src/ directory of the code after")
    ap.add_argument("--parts", nargs="+", default=["cifar10", "resnet50", "stream"],
                    choices=["cifar10", "cifar10-host", "shakespeare", "resnet50", "resnet50-graph", "resnet50-eager",
                             "scenes-detect", "sst2", "multi30k", "ports", "stream"])
    ap.add_argument("--cifar10", help="the CIFAR-10 JPEG folder (cifar10/train, cifar10/test)")
    ap.add_argument("--text", help="tiny Shakespeare's .txt (shakespeare)")
    ap.add_argument("--scenes", help="a digit-scenes folder (scenes-detect)")
    ap.add_argument("--sst2", help="SST-2's folder: train.tsv, dev.tsv (sst2)")
    ap.add_argument("--multi30k", help="Multi30k's folder: train.de/en, val.de/en (multi30k)")
    ap.add_argument("--examples", help="a pytorch/examples checkout (ports)")
    ap.add_argument("--mnist", help="a folder holding MNIST/raw/ (ports)")
    ap.add_argument("--port-scripts", nargs="+", default=["mnist", "word_language_model"])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--stream-epochs", type=int, default=2)
    ap.add_argument("--stream-cpu-decode", type=float,
                    help="stream: the share of each batch its reader processes decode (0: nvJPEG decodes it all; "
                         "by default gpuaccel's choice)")
    ap.add_argument("--work", default="/tmp/redesign")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    trees = {"old": str(Path(args.old).resolve()), "new": str(Path(args.new).resolve())}
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault("meta", {}).update(
        device=torch.cuda.get_device_name(0), torch=torch.__version__,
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"), command=" ".join(sys.argv))
    for part in args.parts:
        if part == "cifar10":
            results["cifar10"] = cifar10(trees, args.cifar10, args.seeds, work)
        elif part == "cifar10-host":
            results["cifar10-host"] = cifar10(trees, args.cifar10, args.seeds, work, ("--loader", "cpu"))
        elif part == "shakespeare":
            results["shakespeare"] = shakespeare(trees, args.text, args.seeds, work)
        elif part == "resnet50":
            results["resnet50"] = resnet50(trees, args.repeats)
        elif part == "resnet50-graph":
            results["resnet50-graph"] = resnet50(trees, args.repeats, "reduce-overhead")
        elif part == "resnet50-eager":
            results["resnet50-eager"] = resnet50(trees, args.repeats, "eager")
        elif part == "scenes-detect":
            results["scenes-detect"] = scenes_detect(trees, args.scenes, args.seeds, work)
        elif part in ("sst2", "multi30k"):
            results[part] = recipe(trees, part, getattr(args, part), args.seeds, work)
        elif part == "ports":
            results["ports"] = ports(trees, args, work)
        elif part == "stream":
            results["stream"] = stream(trees, work, args.repeats, args.stream_epochs, args.stream_cpu_decode)
        out.write_text(json.dumps(results, indent=1))
    for part in args.parts:
        summary = results[part]["summary"]
        if part == "ports":
            for key, per in summary.items():
                old, new = (per.get(n, {}).get("median") for n in ("old", "new"))
                if old and new:
                    print(f"ports {key}: samples/s median old {old:.5g}, new {new:.5g}, new/old {new / old:.4f}")
            continue
        key = "train_seconds" if part in ("cifar10", "cifar10-host", "shakespeare", "scenes-detect", "sst2", "multi30k") \
            else "images_per_second"
        old, new = (summary.get(n, {}).get(key, {}).get("median") for n in ("old", "new"))
        if old and new:
            print(f"{part}: {key} median old {old:.4g}, new {new:.4g}, new/old {new / old:.4f}")


if __name__ == "__main__":
    main()
