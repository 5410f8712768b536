"""Several GPUs of one machine through `gpuaccel train --gpus N` (torch.distributed.run, NCCL),
in four parts, each written to its own JSON file under --out:

    python benchmarks/scaling/scaling.py --gpus 1 2 4 --parts recipe weak exit --out DIR \\
        --cifar10 /tmp/data/cifar10 --text tinyshakespeare.txt

recipe  cifar10-fast (strong scaling: the recipe keeps its global batch of 1536, each of N GPUs
        takes 1536 / N) for --seeds seeds on each GPU count: mean accuracy, training time and
        warm-up against one GPU. Then one GPU alone at each per-GPU batch 1536 / N for the same
        244 steps: the time N GPUs would take if communication were free (the ceiling).
        --recipe-variant GPUS OPTIONS adds a row: the recipe on GPUS GPUs with those options
        (e.g. 4 "--batch-size 2048 --epochs 8 --muon-momentum 0.7"), each seed beside the others.
weak    weak scaling (the batch per GPU fixed, N GPUs take N times the samples per step, and every
        GPU count trains the same number of steps): per-GPU throughput and efficiency =
        throughput(N) / (N x throughput(1)) for ResNet-50 at 224 px (synthetic images; eager, and
        with the whole-step CUDA graph), ResNet-18 on CIFAR-10 with the step graph, the character GPT (shakespeare-char), a
        GPT-2-small-sized model (12 layers, 12 heads, 768 wide, context 1024, a 50,304-row token
        embedding as GPT-2's padded one: 124 M parameters; it reads character tokens, so most
        rows are never looked up, which changes no step's work), the same sharded (--shard,
        FSDP), ResNet-50 and the same GPT as pipelines of two stages (--pipeline-stages 2, from 2
        GPUs; efficiency relative to 2 GPUs), and DLRM on Criteo-shaped synthetic ids (dlrm_trainer.py under
        torch.distributed.run: tables sharded across the processes, their all-to-alls inside the step graph).
exit    a captured Accelerator step on 2 GPUs (tests/accelerator_loop.py acc-capture under
        torchrun) run --exit-runs times: every run must exit 0 within its time bound.
restart ResNet-18 on CIFAR-10 on 2 GPUs with --max-restarts 1 and one worker killed after a
        mid-run checkpoint: it must resume, and end having seen the samples of the same run
        never interrupted (which also runs).

Throughput is the summary's samples/s (tokens/s for the language models): samples over
training time, warm-up, evaluation and checkpoints excluded.
"""

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]  # (the repository)
RUN_TIMEOUT = 600.0  # seconds one training command may take (--run-timeout)


def synthetic_npz(path: Path, train: int, test: int, size: int = 224) -> Path:
    if not path.exists():
        rng = np.random.default_rng(0)
        np.savez(path, x_train=rng.integers(0, 256, (train, 3, size, size), dtype=np.uint8),
                 y_train=rng.integers(0, 1000, train), x_test=rng.integers(0, 256, (test, 3, size, size),
                                                                            dtype=np.uint8),
                 y_test=np.arange(test) % 1000)
    return path


def train(gpus: int | None, run_dir: Path, args: list[str]) -> dict:
    """One `gpuaccel train` command through the launcher with ``gpus`` processes (one plain
    process for 1 or None), and what its summary says."""
    gpus = gpus or 1
    launch = ["--gpus", str(gpus)] if gpus > 1 else []
    return run_and_summarise(gpus, run_dir, [sys.executable, "-m", "gpuaccel", "train", *launch, "--run-dir",
                                             str(run_dir), "--quiet", "--no-monitor", "--no-compile-background", *args])


def train_script(gpus: int, run_dir: Path, script: Path, args: list[str]) -> dict:
    """A training script that takes --run-dir, under torch.distributed.run with ``gpus`` processes."""
    return run_and_summarise(gpus, run_dir, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                             f"--nproc-per-node={gpus}", str(script), "--run-dir", str(run_dir),
                                             *args])


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux /proc). torch.distributed.run starts each
    worker in a session of its own, so a signal to the launcher's process group misses them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def signal_processes(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def run_and_summarise(gpus: int, run_dir: Path, cmd: list[str]) -> dict:
    """Runs ``cmd`` and reads the run's summary. A run past RUN_TIMEOUT seconds gets SIGABRT in
    every process, on which each Python process prints its stacks (PYTHONFAULTHANDLER), then
    SIGKILL. A failed run's output is kept in ``run_dir``/output.log."""
    shutil.rmtree(run_dir, ignore_errors=True)  # (a run directory that holds a run is refused)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        tree = process_tree(proc.pid)  # (before the launcher dies and its workers lose their parent)
        signal_processes(tree[1:], signal.SIGABRT)  # the workers first: the launcher would stop them
        time.sleep(5)
        signal_processes(tree[:1], signal.SIGABRT)
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            signal_processes(tree, signal.SIGKILL)
            output, _ = proc.communicate()
    wall = time.perf_counter() - start
    row = {"gpus": gpus, "command": " ".join(cmd[2:]), "command_wall_seconds": round(wall, 1)}
    if proc.returncode != 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        log = run_dir / "output.log"
        log.write_text(output)
        errors = [line for line in output.splitlines() if line.startswith("gpuaccel: error:")]
        return {**row, "error": errors[-1] if errors else output[-1500:], "exit_status": proc.returncode,
                "timed_out": wall >= RUN_TIMEOUT, "log": str(log)}
    s = json.loads((run_dir / "summary.json").read_text())
    return {**row, "samples_per_second": s["samples_per_second"], "tokens_per_second": s.get("tokens_per_second"),
            "train_seconds": s["train_seconds"], "warmup_seconds": s["warmup_seconds"], "metrics": s["metrics"],
            "global_batch_size": s["global_batch_size"], "epochs": s["epochs"], "steps": s["steps"],
            "peak_gpu_memory_gib": s.get("peak_gpu_memory_gib"), "parameters": s["parameters"]}


def recipe_part(args, work: Path) -> dict:
    # (label, GPUs, options): the recipe as shipped on every count, then each variant asked for
    settings = [(str(n), n, []) for n in args.gpus]
    settings += [(f"{gpus} {options}", int(gpus), shlex.split(options)) for gpus, options in args.recipe_variant]
    rows = []
    for seed in range(args.seeds):
        for index, (label, n, options) in enumerate(settings):  # alternated: drift spreads over every row
            row = train(n, work / f"recipe-{index}-{seed}", ["--recipe", "cifar10-fast", "--data", args.cifar10,
                                                             "--seed", str(seed), *options])
            rows.append({**row, "seed": seed, "setting": label})
            print("recipe", json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
    ceiling = []
    for n in [n for n in args.gpus if n > 1]:  # one GPU at 1536 / n images a step, the same 244 steps
        row = train(1, work / f"recipe-ceiling-{n}", ["--recipe", "cifar10-fast", "--data", args.cifar10,
                                                      "--batch-size", str(1536 // n), "--epochs", str(7.6 / n)])
        ceiling.append({**row, "as_if_gpus": n})
        print("ceiling", json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
    table = {}
    for label, _, _ in settings:
        ok = [r for r in rows if r["setting"] == label and "error" not in r]
        if ok:
            table[label] = {"runs": len(ok), "accuracy_mean": statistics.mean(r["metrics"]["accuracy"] for r in ok),
                            "accuracy": [r["metrics"]["accuracy"] for r in ok],
                            "train_seconds_median": statistics.median(r["train_seconds"] for r in ok),
                            "warmup_seconds_median": statistics.median(r["warmup_seconds"] for r in ok),
                            "step_ms": 1000 * statistics.median(r["train_seconds"] for r in ok) / ok[0]["steps"]}
    one = table.get("1")
    for t in table.values():
        if one:
            t["train_time_vs_one_gpu"] = t["train_seconds_median"] / one["train_seconds_median"]
            t["warmup_vs_one_gpu"] = t["warmup_seconds_median"] / one["warmup_seconds_median"]
    for c in ceiling:
        if "error" not in c and one:
            c["step_ms"] = 1000 * c["train_seconds"] / c["steps"]
            c["ceiling_time_vs_one_gpu"] = c["step_ms"] / one["step_ms"]
    return {"recipe": "cifar10-fast", "scaling": "strong (global batch 1536 kept)", "table": table, "runs": rows,
            "ceiling": ceiling}


def weak_workloads(args, work: Path) -> dict:
    """name -> (command arguments for n GPUs, epochs at the smallest GPU count): n GPUs read n
    times the samples per step, so they train n times the epochs for the same steps."""
    text = ["--data", args.text]
    gpt2 = ["--model", "gpt", "--model-args", "layers=12,heads=12,width=768,dropout=0,vocab_size=50304",
            "--tokenizer", "char", "--context", "1024", "--batch-size", "16", "--optimizer", "adamw", "--lr", "6e-4",
            "--eval-every", "1000000", "--eval-batch-size", "64", "--precision", "bf16"]
    resnet50 = ["--model", "resnet50", "--batch-size", "128", "--lr", "0.1", "--eval-every", "1000000",
                "--eval-batch-size", "256"]
    resnet18 = ["--data", args.cifar10, "--model", "resnet18", "--batch-size", "512", "--eval-every", "1000000",
                "--lr", "0.2", "--crop-padding", "4", "--flip", "random"]

    def images_224():
        return ["--data", f"npz:{synthetic_npz(work / 'synthetic-224.npz', 8192, 512)}"]

    return {
        # 6 epochs of the 8,192 images: 384 steps, 11 s on one H200 eager (2 epochs' 128 steps took
        # under 4 s, and one slow step of one process moved the efficiency by several points)
        "resnet50-224": (lambda: [*images_224(), *resnet50], 6),
        # (with the step graph the host does not pace the step; eager, batch 128 is close to host-bound)
        "resnet50-224-graph": (lambda: [*images_224(), *resnet50, "--compile", "--compile-mode", "reduce-overhead"], 6),
        "resnet18-cifar-graph": (lambda: [*resnet18, "--compile", "--compile-mode", "reduce-overhead"], 4),
        "shakespeare-char": (lambda: ["--recipe", "shakespeare-char", *text, "--no-global-batch",
                                      "--eval-every", "1000000"], 8),
        "gpt2-small": (lambda: [*text, *gpt2, "--compile"], 4),
        "gpt2-small-shard": (lambda: [*text, *gpt2, "--shard", "--compile"], 4),
        "dlrm": (None, None),  # benchmarks/scaling/dlrm_trainer.py: the same steps on every GPU count
        "resnet50-224-pipeline2": (lambda: [*images_224(), *resnet50, "--pipeline-stages", "2"], 2),
        "gpt2-small-pipeline2": (lambda: [*text, *gpt2, "--pipeline-stages", "2"], 4),
    }


def weak_part(args, work: Path, out: Path) -> dict:
    results = {}
    for name, make in weak_workloads(args, work).items():
        if args.only and name not in args.only:
            continue
        counts = [n for n in args.gpus if n >= 2] if "pipeline" in name else args.gpus
        rows = []
        for n in counts:
            if name == "dlrm":
                row = train_script(n, work / f"{name}-{n}", Path(__file__).with_name("dlrm_trainer.py"),
                                   ["--batch", "32768", "--steps", "400"])
            else:
                arguments, epochs = make
                row = train(n, work / f"{name}-{n}",
                            [*arguments(), "--epochs", str(args.epochs_scale * epochs * n / counts[0])])
            rows.append(row)
            print(name, json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
        unit = "tokens_per_second" if "gpt" in name or "shakespeare" in name else "samples_per_second"
        base = next((r for r in rows if "error" not in r), None)
        for r in rows:
            if "error" not in r and base:
                r["per_gpu"] = r[unit] / r["gpus"]
                r["efficiency"] = r["per_gpu"] / (base[unit] / base["gpus"])
        results[name] = {"unit": unit, "efficiency_relative_to": f"{base['gpus']} GPU(s)" if base else None,
                         "rows": rows}
        out.write_text(json.dumps({**header(), "workloads": results}, indent=2) + "\n")  # kept if cut short
    return {"workloads": results}


def exit_part(args, work: Path) -> dict:
    """Every run of a captured 2-GPU Accelerator loop exits 0 after acc.end(), within its bound:
    ``--exit-modes`` of tests/accelerator_loop.py (acc-capture: a step function; acc-captured:
    nanoGPT's micro-step loop), ``--exit-runs`` each, alternated."""
    runs = []
    for i in range(args.exit_runs):
        for mode in args.exit_modes:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   str(ROOT / "tests" / "accelerator_loop.py"), str(work / f"exit-{i}.pt"), mode, "64", "4"]
            start = time.perf_counter()
            try:
                done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=args.exit_bound,
                                      env={**os.environ, "GPUACCEL_LOOP_DEVICE": "cuda"})
                code, tail = done.returncode, (done.stdout + done.stderr)[-600:]
            except subprocess.TimeoutExpired:
                code, tail = "timeout", ""
            captured = code == 0 and torch.load(work / f"exit-{i}.pt", weights_only=True).get("captured")
            runs.append({"mode": mode, "exit_status": code, "captured": captured,
                         "seconds": round(time.perf_counter() - start, 1), "output_tail": tail})
            print("exit", mode, code, captured, runs[-1]["seconds"], flush=True)
    return {"command": "torch.distributed.run --standalone --nproc-per-node=2 tests/accelerator_loop.py OUT.pt "
                       "MODE 64 4", "bound_seconds": args.exit_bound, "runs": runs,
            "all_exited_cleanly": all(r["exit_status"] == 0 for r in runs),
            "all_captured": all(r["captured"] for r in runs)}


def restart_part(args, work: Path) -> dict:
    """ResNet-18 on CIFAR-10 on 2 GPUs with --max-restarts 1: one worker is killed (SIGKILL)
    after a mid-run checkpoint; the launcher restarts the group, which resumes. Compared with
    the same run never interrupted: restarts, samples seen, evaluations, final metrics."""
    common = ["--data", args.cifar10, "--model", "resnet18", "--batch-size", "256", "--epochs", "6",
              "--checkpoint-every", "40", "--eval-batch-size", "1000"]
    straight = train(2, work / "restart-straight", common)
    run_dir = work / "restart-killed"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "gpuaccel", "train", "--gpus", "2", "--max-restarts", "1", "--run-dir", str(run_dir),
           "--quiet", "--no-monitor", *common]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed, deadline = None, time.time() + RUN_TIMEOUT
    while killed is None and launcher.poll() is None and time.time() < deadline:
        state = run_dir / "checkpoint.json"
        if state.exists() and json.loads(state.read_text() or "{}").get("global_step", 0) >= 40:
            workers = [pid for pid in process_tree(launcher.pid) if _is_worker(pid)]
            if workers:
                killed = max(workers)
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.01)
    try:
        output, _ = launcher.communicate(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        signal_processes(process_tree(launcher.pid), signal.SIGKILL)
        output, _ = launcher.communicate()
    row = {"command": " ".join(cmd[2:]), "exit_status": launcher.returncode, "killed_worker": killed is not None}
    if launcher.returncode != 0 or not (run_dir / "summary.json").exists():
        return {"straight": straight, "killed": {**row, "output_tail": output[-2000:]}, "resumed_like_straight": False}
    s = json.loads((run_dir / "summary.json").read_text())
    epochs = [json.loads(line)["epoch"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    row.update(restarts=s["restarts"], samples_seen=s["samples_seen"], stopped_by=s["stopped_by"],
               metrics=s["metrics"], evaluated_epochs=epochs)
    same = "error" not in straight and s["restarts"] == 1 and s["samples_seen"] == json.loads(
        (work / "restart-straight" / "summary.json").read_text())["samples_seen"] and s["stopped_by"] == "epochs"
    return {"straight": straight, "killed": row, "resumed_like_straight": same}


def _is_worker(pid: int) -> bool:
    """A process torch.distributed.run started for a rank (it has LOCAL_RANK in its environment)."""
    try:
        return b"LOCAL_RANK=" in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def header() -> dict:
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count()}


def main():
    global RUN_TIMEOUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--parts", nargs="+", default=["recipe", "weak", "exit", "restart"],
                    choices=["recipe", "weak", "exit", "restart"])
    ap.add_argument("--cifar10", help="the CIFAR-10 folder (recipe, weak)")
    ap.add_argument("--text", help="tiny Shakespeare (weak)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--recipe-variant", nargs=2, action="append", default=[], metavar=("GPUS", "OPTIONS"),
                    help="recipe: also the recipe on GPUS GPUs with OPTIONS (one string of train options)")
    ap.add_argument("--only", nargs="*", help="weak: these workloads only")
    ap.add_argument("--epochs-scale", type=float, default=1.0,
                    help="weak: each workload's epochs times this (a shorter check: 0.25)")
    ap.add_argument("--exit-runs", type=int, default=10)
    ap.add_argument("--exit-modes", nargs="+", default=["acc-capture", "acc-captured"],
                    choices=["acc-capture", "acc-captured"])
    ap.add_argument("--exit-bound", type=float, default=120, help="seconds a run of the exit part may take")
    ap.add_argument("--run-timeout", type=float, default=RUN_TIMEOUT,
                    help="seconds one training command may take; then its stacks go to a log beside its run directory")
    ap.add_argument("--work", default="/tmp/scaling")
    ap.add_argument("--out", required=True, help="a folder: recipe.json, weak.json, exit.json, restart.json")
    args = ap.parse_args()
    RUN_TIMEOUT = args.run_timeout
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    for part in args.parts:
        if part == "weak":
            result = weak_part(args, work, out / "weak.json")
        else:
            result = {"recipe": recipe_part, "exit": exit_part, "restart": restart_part}[part](args, work)
        (out / f"{part}.json").write_text(json.dumps({**header(), "command": " ".join(sys.argv), **result},
                                                     indent=2) + "\n")


if __name__ == "__main__":
    main()
