"""gpuaccel's CIFAR-10 recipes against KellerJordan's airbench, side by side on one GPU in one command.

    python benchmarks/airbench/airbench_side_by_side.py --airbench DIR --data /tmp/data/cifar10 \\
        --pair cifar10-fast=airbench94_muon.py --runs 5 --seeds 5 --out results.json

DIR holds airbench's scripts as published (github.com/KellerJordan/cifar10-airbench, fetched into
an ignored folder: they are not part of this repository). So that both train on the same pixels,
the CIFAR-10 folder is decoded once by gpuaccel's reader and written in the form airbench loads
(``cifar10/train.pt`` and ``test.pt`` under ``--work``: uint8 NHWC images, labels, class names).

airbench runs in its own process, exactly as its ``__main__`` does (the network compiled with its
published mode; airbench94 makes one warm-up run first), with two changes made to its source text
in memory: the number of runs (200 there, ``--runs`` here) and, with ``--airbench-compile default``,
its compile mode. Its time is its own: CUDA events around its training and its final test-time-
augmented evaluation, per-epoch evaluations excluded. It is read from the table it prints (the
last row of each run); the last training row gives its training time without that evaluation.
The first run's time is left out of the means (a warm-up, or a run that includes compiling).

gpuaccel runs each recipe through ``Trainer`` in this process, one run per seed, as shipped or
with each ``--variant``'s overrides: its training time is from the first step to the last, evaluations
excluded (reported apart, from the run's phases). Each gets ``time_ratio_to_airbench`` per airbench
compile mode measured, and ``time_ratio_to_airbench_training`` against airbench's training alone.
``--order gpuaccel-first`` runs ours first: airbench96's first run compiles for 6.5-7.5 minutes on an
H200 (max-autotune), which can use up a time limit before anything else has run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


def write_airbench_data(data, work: Path) -> dict:
    """The data set (a gpuaccel ImageDataset) as airbench's CifarLoader reads it:
    ``cifar10/{train,test}.pt``."""
    import torch

    folder = work / "cifar10"
    folder.mkdir(parents=True, exist_ok=True)
    for name, images, labels in (("train", data.train_images, data.train_labels),
                                 ("test", data.test_images, data.test_labels)):
        torch.save({"images": torch.from_numpy(images).permute(0, 2, 3, 1).contiguous(),
                    "labels": torch.from_numpy(labels), "classes": list(data.classes)}, folder / f"{name}.pt")
    return {"train_images": len(data.train_labels), "test_images": len(data.test_labels), "classes": data.classes}


def run_reference(script: Path, runs: int, default_compile: bool) -> None:
    """(In the child process, cwd = the work folder.) airbench's script as its __main__ runs it."""
    source = script.read_text()
    if "range(200)" not in source:
        raise SystemExit(f"{script}: no 'range(200)' to set the number of runs in")
    source = source.replace("range(200)", f"range({runs})")
    if default_compile:
        source = source.replace("mode='max-autotune'", "mode='default'").replace('mode="max-autotune"',
                                                                                 'mode="default"')
    sys.argv = [str(script)]  # it reads its own source for its log
    exec(compile(source, str(script), "exec"), {"__name__": "__main__", "__file__": str(script)})


def parse_table(stdout: str) -> list[dict]:
    """airbench's printed rows, one dict per run: its label (airbench94 names its warm-up run
    "warmup"), its final (TTA) accuracy, its time and the time of its last training row (before
    the final evaluation)."""
    header, results, last_train, label = None, [], None, None
    for line in stdout.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cells
            continue
        row = dict(zip(header, cells))
        label = row.get("run") or label
        time_key = "time_seconds" if "time_seconds" in row else "total_time_seconds"
        if row.get("epoch") == "eval":
            results.append({"run": label, "tta_val_acc": float(row["tta_val_acc"]), "seconds": float(row[time_key]),
                            "train_seconds": last_train})
        elif row.get(time_key):
            last_train = float(row[time_key])
    return results


def reference(script: Path, runs: int, work: Path, default_compile: bool) -> dict:
    args = [sys.executable, str(Path(__file__).resolve()), "--reference", str(script), "--runs", str(runs)]
    if default_compile:
        args.append("--default-compile")
    start = time.perf_counter()
    done = subprocess.run(args, cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        return {"script": script.name, "error": (done.stdout + done.stderr)[-3000:]}
    rows = parse_table(done.stdout)
    # airbench94 warms its compiled network up with a run on random labels first; airbench96's
    # first run is a real one, but its time includes compiling: its accuracy counts, its time not
    warmup = rows[0]["run"] == "warmup"
    timed = rows[1:]
    seconds = [r["seconds"] for r in timed]
    accuracies = [r["tta_val_acc"] for r in (timed if warmup else rows)]
    return {"script": script.name, "compile": "default" if default_compile else "as published",
            "runs": timed, "first_run": rows[0], "first_run_is_warmup": warmup, "process_seconds": round(wall, 1),
            "printed": done.stdout,
            "seconds_mean": statistics.mean(seconds), "seconds_median": statistics.median(seconds),
            "seconds_min": min(seconds), "seconds_max": max(seconds),
            "train_seconds_mean": statistics.mean(r["train_seconds"] for r in timed),
            "accuracy_mean": statistics.mean(accuracies), "accuracy_runs": len(accuracies)}


def recipe_runs(recipe: str, data_spec: str, dataset, seeds: int, overrides: dict) -> dict:
    from gpuaccel.train.recipes import load_recipe
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    from tune_recipe import run_seeds  # (benchmarks/recipes/)

    runs = []
    for seed, s in enumerate(run_seeds(load_recipe(recipe), data_spec, dataset, overrides, range(1, seeds + 1)), 1):
        phases = dict(s["phases"])
        runs.append({"seed": seed, "train_seconds": s["train_seconds"], "accuracy": s["metrics"]["accuracy"],
                     "warmup_seconds": s["warmup_seconds"], "epochs": s["epochs"],
                     "evaluation_seconds": next((v for k, v in phases.items() if k.startswith("evaluations")), None)})
    return {"recipe": recipe, "overrides": overrides, "runs": runs, "device": s["device_name"],
            "train_seconds_mean": statistics.mean(r["train_seconds"] for r in runs),
            "train_seconds_median": statistics.median(r["train_seconds"] for r in runs),
            "accuracy_mean": statistics.mean(r["accuracy"] for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--airbench", type=Path, help="the folder holding airbench's scripts")
    ap.add_argument("--data", help="the CIFAR-10 folder (or any spec gpuaccel reads)")
    ap.add_argument("--pair", action="append", default=[], metavar="RECIPE=SCRIPT",
                    help="a gpuaccel recipe and the airbench script it is measured against")
    ap.add_argument("--runs", type=int, default=5, help="timed airbench runs per script")
    ap.add_argument("--seeds", type=int, default=5,
                    help="gpuaccel runs per recipe and variant (seeds 1..N; 0: airbench alone)")
    ap.add_argument("--variant", action="append", default=[], metavar="JSON",
                    help="recipe overrides to measure, each in turn ('{}': the recipe as shipped, the default)")
    ap.add_argument("--airbench-compile", nargs="+", choices=("published", "default"), default=["published"],
                    help="airbench's compile modes to run, in turn: as published, torch.compile's default mode")
    ap.add_argument("--default-compile", action="store_true", help=argparse.SUPPRESS)  # (the child process)
    ap.add_argument("--order", choices=("airbench-first", "gpuaccel-first"), default="airbench-first",
                    help="which side runs first (gpuaccel first: ours still runs when airbench's compiling "
                         "would use up a time limit)")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "airbench-work")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--reference", type=Path, help=argparse.SUPPRESS)  # (the child process)
    args = ap.parse_args()
    if args.reference:
        run_reference(args.reference, args.runs, args.default_compile)
        return

    import torch

    import gpuaccel

    dataset = gpuaccel.load_dataset(args.data)  # decoded once (and cached): both sides train on these pixels
    args.work.mkdir(parents=True, exist_ok=True)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "command": " ".join(sys.argv), "data": write_airbench_data(dataset, args.work), "pairs": []}

    def save():
        for measured in result["pairs"]:  # ours against each of airbench's compile modes measured so far
            for ours in measured["gpuaccel"]:
                timed = [ref for ref in measured["airbench"] if "seconds_mean" in ref]
                ours["time_ratio_to_airbench"] = {
                    ref["compile"]: round(ours["train_seconds_mean"] / ref["seconds_mean"], 4) for ref in timed}
                # (airbench's time holds its final evaluation, ours does not: against its training alone too)
                ours["time_ratio_to_airbench_training"] = {
                    ref["compile"]: round(ours["train_seconds_mean"] / ref["train_seconds_mean"], 4) for ref in timed}
        if args.out:  # after every part, so a run cut short keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))

    for pair in args.pair:
        recipe, script = pair.split("=", 1)
        entry = {"recipe": recipe, "script": script, "order": args.order, "airbench": [], "gpuaccel": []}
        result["pairs"].append(entry)

        def run_airbench():
            for default_compile in [mode == "default" for mode in args.airbench_compile]:
                ref = reference(args.airbench.resolve() / script, args.runs, args.work, default_compile)
                entry["airbench"].append(ref)
                print(json.dumps({k: v for k, v in ref.items() if k not in ("runs", "first_run", "printed")}),
                      flush=True)
                save()

        def run_gpuaccel():
            if not args.seeds:  # --seeds 0: airbench alone
                return
            for overrides in [json.loads(v) for v in args.variant] or [{}]:
                entry["gpuaccel"].append(recipe_runs(recipe, args.data, dataset, args.seeds, overrides))
                print(json.dumps({k: v for k, v in entry["gpuaccel"][-1].items() if k != "runs"}), flush=True)
                save()

        for part in (run_gpuaccel, run_airbench) if args.order == "gpuaccel-first" else (run_airbench, run_gpuaccel):
            part()


if __name__ == "__main__":
    main()
