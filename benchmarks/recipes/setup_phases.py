"""Where a recipe's set-up goes before training starts: builds its ``Trainer`` (no training) and
writes the run's set-up phases, one process a run (each pays its own imports), e.g.

    PYTHONPATH=src python3 benchmarks/recipes/setup_phases.py --recipe cifar10-fast \\
        --data /tmp/data/cifar10 --device cpu --runs 3 --out setup_phases.json

``--concurrent N`` starts N such processes at once, as ``--gpus N`` does, and records when each
one's set-up ended (``arrived_s``, from the common start): a run on N GPUs begins its warm-up by
waiting for the last to arrive, so the spread of arrivals is what N processes add to it. With
one GPU the N processes share it; their CUDA initialisations then contend for one device, the
other phases (imports, reading the data, building the model) for the host as on N GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

STARTED = time.time()  # (before the imports below: a process's imports are part of its set-up)


def one_run(recipe: str, data: str, device: str, launched: float) -> dict:
    import torch

    import gpuaccel
    from gpuaccel.train.recipes import load_recipe

    settings = {**load_recipe(recipe), "data": data, "device": device, "run_dir": None, "monitor": False}
    trainer = gpuaccel.Trainer(gpuaccel.TrainConfig.from_dict(settings), quiet=True)
    return {"torch": torch.__version__, "device": str(trainer.device),
            "python_started_s": round(STARTED - launched, 3),
            "arrived_s": round(time.time() - launched, 3),
            "phases": {name: round(seconds, 3) for name, seconds in trainer.times.phases.phases.items()}}


def launch(args, count: int) -> list[dict]:
    """``count`` processes started at once; each one's result. Their output goes to files, not
    pipes: a process whose pipe nobody reads while another is waited for could block on it, and
    arrive late."""
    launched = time.time()
    command = [sys.executable, __file__, "--one", "--recipe", args.recipe, "--data", args.data,
               "--device", args.device, "--launched", repr(launched)]
    with tempfile.TemporaryDirectory() as folder:
        outputs = [Path(folder) / f"process-{i}.txt" for i in range(count)]
        processes = []
        for output in outputs:
            with open(output, "w") as sink:
                processes.append(subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, text=True))
        results = []
        for process, output in zip(processes, outputs):
            process.wait()
            text = output.read_text(errors="replace")
            if process.returncode != 0:
                raise SystemExit(f"a set-up process failed ({process.returncode}):\n{text[-3000:]}")
            results.append(json.loads(next(line for line in reversed(text.splitlines()) if line.startswith("{"))))
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="cifar10-fast")
    ap.add_argument("--data", required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrent", type=int, nargs="+", default=[1],
                    help="processes started at once (several counts: alternated, run by run)")
    ap.add_argument("--out")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (a run's own process)
    ap.add_argument("--launched", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_run(args.recipe, args.data, args.device, args.launched or STARTED)))
        return
    runs = []
    for _ in range(args.runs):
        for count in args.concurrent:
            processes = launch(args, count)
            arrivals = [p["arrived_s"] for p in processes]
            runs.append({"concurrent": count, "processes": processes, "last_arrival_s": max(arrivals),
                         "arrival_spread_s": round(max(arrivals) - min(arrivals), 3)})
            print(json.dumps({"concurrent": count, "arrived_s": arrivals,
                              "phases": [p["phases"] for p in processes]}), flush=True)
    summary = {}
    for count in args.concurrent:
        mine = [run for run in runs if run["concurrent"] == count]
        summary[str(count)] = {key + "_median": round(statistics.median(r[key] for r in mine), 3)
                               for key in ("last_arrival_s", "arrival_spread_s")}
    print(json.dumps(summary))
    result = {"command": " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "cpu_cores": os.cpu_count(), "summary": summary, "runs": runs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
