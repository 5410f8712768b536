"""Each recipe's whole command, cold and warm: ``gpuaccel train --recipe NAME --data DATA`` as a
user types it, timed from the shell's side, with its phases from the run's summary.

    python benchmarks/cold_start/cold_start.py --run cifar10-fast=/tmp/data/cifar10 \\
        --run shakespeare-char=tinyshakespeare.txt --warm 2 --out cold_start.json

Cold: gpuaccel's cache folder (``GPUACCEL_CACHE_DIR``: the decoded data, the interpreter's
bytecode for Dynamo and Inductor, Inductor's compiled graphs and kernels), Triton's own
(``TRITON_CACHE_DIR``) and the CUDA driver's (``CUDA_CACHE_PATH``: the kernels built at run time,
such as cuDNN's attention) are new and empty, as on a machine that never ran gpuaccel; the
operating system's file cache is not emptied (it is filled with torch's sources before the
first command, so that no tree compared pays for reading them). Warm: the same command again
with those folders as the cold run left them (``--warm`` times). ``--run NAME=DATA:OPTIONS`` adds options to a
recipe's command (after a colon, shell-quoted).

Reported per command: the whole command's seconds, and from the summary the start-up (the
interpreter, imports, the command line), the set-up (the device, data, model, importing
torch.compile), the warm-up (compiling and recording the step, phase by phase), training and
the rest (evaluations, checkpoints, the summary, the exit); and the issue's aim for a cold
command, at most twice the training time plus 10 s: the training time of the last warm command
(a cold one may train uncompiled while its compile runs in the background,
``compile_plan: background``; the seconds the next command waited for that are
``background_compile_seconds``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path


def background_compiles(cache: Path) -> float:
    """Waits for the compiles a cold command left to a background process (--compile-background:
    each holds a lock file naming its process); returns the seconds waited."""
    start = time.perf_counter()
    for lock in (cache / "inductor" / "gpuaccel-compiled").glob("*.compiling"):
        while lock.exists():
            try:
                os.kill(int(lock.read_text()), 0)
            except (ProcessLookupError, ValueError, FileNotFoundError):
                break
            time.sleep(0.2)
    return round(time.perf_counter() - start, 2)


def whole_command(recipe: str, data: str, options: list[str], cache: Path, run_dir: Path, src: str | None) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "GPUACCEL_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton"),
           "CUDA_CACHE_PATH": str(cache / "cuda")}
    if src:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    command = [sys.executable, "-m", "gpuaccel", "train", "--recipe", recipe, "--data", data,
               "--run-dir", str(run_dir), "--json", *options]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode:
        return {"error": (done.stdout + done.stderr)[-3000:], "command_seconds": round(seconds, 2)}
    s = json.loads(done.stdout[done.stdout.index("{"):])
    # start-up: the interpreter, imports and the command line, before the Trainer's set-up begins
    startup = next((v for k, v in (s.get("phases") or {}).items() if k.startswith("start-up")), 0.0)
    setup, warmup, train = s["setup_seconds"], s["warmup_seconds"], s["train_seconds"]
    return {"command_seconds": round(seconds, 2), "compile_plan": s.get("compile_plan"), "startup_seconds": startup, "setup_seconds": setup,
            "warmup_seconds": warmup, "train_seconds": train,
            "rest_seconds": round(seconds - startup - setup - warmup - train, 2),
            "warmup_phases": s["warmup_phases"], "phases": s.get("phases"), "steps": s["steps"],
            "metrics": s["metrics"],
            "aim_seconds": round(2 * train + 10, 2), "within_aim": seconds <= 2 * train + 10}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True, metavar="RECIPE=DATA[:OPTIONS]")
    p.add_argument("--warm", type=int, default=1, help="warm commands after each cold one")
    p.add_argument("--src", action="append", default=[None], metavar="DIR",
                   help="also run gpuaccel from this source folder (its PYTHONPATH), to compare two trees: "
                        "each recipe cold and warm with the installed one, then with each DIR")
    p.add_argument("--work", default="/tmp/cold_start")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import torch

    # the operating system's file cache holds the sources of torch and its compiler before the
    # first command, as before every later one: otherwise whichever tree runs first reads them
    # from disk (seconds of its start-up)
    subprocess.run([sys.executable, "-c", "import torch._inductor.compile_fx"], check=True)
    work = Path(args.work)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "cpus": os.cpu_count(), "recipes": {}}
    for spec in args.run:
        recipe, _, rest = spec.partition("=")
        data, _, options = rest.partition(":")
        for src in args.src:
            cache = work / f"cache-{recipe}"
            shutil.rmtree(cache, ignore_errors=True)
            rows = {"options": shlex.split(options), "src": src, "cold": None, "warm": []}
            rows["cold"] = whole_command(recipe, data, rows["options"], cache, work / "run", src)
            # a warm command is one after the compile: where the cold one left it to a background
            # process, the next waits for that process (how long: after the cold command ended)
            rows["cold"]["background_compile_seconds"] = background_compiles(cache)
            print(recipe, src or "", "cold", json.dumps(rows["cold"])[:2000], flush=True)
            for _ in range(args.warm):
                rows["warm"].append(whole_command(recipe, data, rows["options"], cache, work / "run", src))
                print(recipe, src or "", "warm", json.dumps(rows["warm"][-1])[:2000], flush=True)
            trained = rows["warm"][-1].get("train_seconds") if rows["warm"] else None
            if trained is not None and "command_seconds" in rows["cold"]:
                rows["cold"]["aim_seconds"] = round(2 * trained + 10, 2)
                rows["cold"]["within_aim"] = rows["cold"]["command_seconds"] <= rows["cold"]["aim_seconds"]
            # (a recipe with other options, or from another tree: a row of its own)
            key = " ".join(filter(None, [recipe, options, src and f"[{src}]"]))
            result["recipes"][key] = rows
            Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
