"""Where a recipe's set-up goes before training starts: builds its ``Trainer`` (no training) and
writes the run's set-up phases, one process a run (each pays its own imports), e.g.

    PYTHONPATH=src python3 benchmarks/recipes/setup_phases.py --recipe cifar10-fast \\
        --data /tmp/data/cifar10 --device cpu --runs 3 --out setup_phases.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import datetime, timezone


def one_run(recipe: str, data: str, device: str) -> dict:
    import torch

    import gpuaccel
    from gpuaccel.train.recipes import load_recipe

    settings = {**load_recipe(recipe), "data": data, "device": device, "run_dir": None, "monitor": False}
    trainer = gpuaccel.Trainer(gpuaccel.TrainConfig.from_dict(settings), quiet=True)
    return {"torch": torch.__version__, "device": str(trainer.device),
            "phases": {name: round(seconds, 3) for name, seconds in trainer.phases.phases.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="cifar10-fast")
    ap.add_argument("--data", required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (a run's own process)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_run(args.recipe, args.data, args.device)))
        return
    runs = []
    for _ in range(args.runs):
        done = subprocess.run([sys.executable, __file__, "--one", "--recipe", args.recipe, "--data", args.data,
                               "--device", args.device], capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]["phases"]), flush=True)
    result = {"command": " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "cpu_cores": os.cpu_count(), "runs": runs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
