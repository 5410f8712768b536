"""Public training scripts ported to gpuaccel.Accelerator, measured against themselves.

For each script of pytorch/examples (a checkout of it is given; nothing of it is kept here):
the original, a plain port (``prepare``, ``autocast``, ``backward``: ``port.diff``) and a port
whose step is captured as one CUDA graph (``capture.diff``), each after the same two-line
instrumentation (``instrument.diff``: ``steptimer.tick`` once per step). Every variant runs in
its own process, alternated over ``--repeats`` rounds; each reports steps/s, samples/s and the
mean training loss of its timed steps (steptimer.py). Changed lines are counted from the diffs:
added and removed, and how many added lines were moved from elsewhere in the script (a step's
body moved into a function) rather than written.

    python benchmarks/porting/run_ports.py --examples ~/pytorch-examples --cifar ~/data/cifar10 \\
        --mnist ~/data --text ~/data/shakespeare-words --out benchmarks/porting/results/ports.json

A change to gpuaccel, timed on a port without the host's drift between processes: one variant
with two gpuaccel trees at once, taking turns step by step (each step of the tree after over its
neighbours of the tree before):

    python benchmarks/porting/run_ports.py --examples ~/pytorch-examples --mnist ~/data --scripts mnist \
        --variants port --paired --src-before /tmp/before/src --repeats 4 --steps 900

``--cifar``: an image folder with train/ and test/ (imagenet takes test/ as its val/);
``--mnist``: a folder holding MNIST/raw/ with the four IDX files; ``--text``: a folder with
train.txt, valid.txt and test.txt (word_language_model's layout).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ratio_stats import median_interval95  # (this folder)

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
VARIANTS = ("original", "port", "capture")
# variants measured for one script only, run when asked for: word_language_model's plain port with
# precision forced to fp32, against which 'auto' (tf32 for a model with recurrent layers) is timed
EXTRA_VARIANTS = ("port_fp32",)

# script folder -> (its arguments, timed steps after the warm-up)
SCRIPTS = {
    "mnist": (["../main.py", "--epochs", "1"], 300),
    "imagenet": (["main.py", "{cifar}", "-a", "resnet18", "-b", "256", "-j", "12", "--epochs", "1", "-p", "100000"], 60),
    "word_language_model": (["main.py", "--accel", "--data", "{text}", "--epochs", "6"], 200),
    "dcgan": (["main.py", "--dataset", "folder", "--dataroot", "{cifar}/train", "--imageSize", "64", "--accel",
               "--niter", "1", "--workers", "4", "--outf", "out", "--manualSeed", "1"], 300),
    # nanoGPT's train.py with config/train_shakespeare_char.py's settings (evaluated at step 0 only)
    "nanogpt": (["train.py", "--dataset=shakespeare_char", "--gradient_accumulation_steps=1", "--batch_size=64",
                 "--block_size=256", "--n_layer=6", "--n_head=6", "--n_embd=384", "--dropout=0.2",
                 "--learning_rate=1e-3", "--max_iters=5000", "--lr_decay_iters=5000", "--min_lr=1e-4", "--beta2=0.99",
                 "--warmup_iters=100", "--eval_interval=5000", "--log_interval=10", "--always_save_checkpoint=False",
                 "--out_dir=out"], 300),
}
NANOGPT_FILES = ("train.py", "model.py", "configurator.py")


def changed_lines(diff: Path) -> dict:
    added = [line[1:] for line in diff.read_text().splitlines() if line.startswith("+") and not line.startswith("+++")]
    removed = [line[1:] for line in diff.read_text().splitlines() if line.startswith("-") and not line.startswith("---")]
    added, removed = [a for a in added if a.strip()], [r for r in removed if r.strip()]
    pool = [r.strip() for r in removed]
    moved = 0
    for line in added:
        if line.strip() in pool:
            pool.remove(line.strip())
            moved += 1
    return {"added": len(added), "removed": len(removed), "moved": moved, "written": len(added) - moved}


def prepare(examples: Path, script: str, variant: str, root: Path, args) -> Path:
    """A copy of the script's folder with the instrumentation (and the variant's diff) applied."""
    work = root / f"{script}-{variant}"
    if script == "nanogpt":  # its three files, and its character-level data as its prepare.py makes it
        work.mkdir()
        for name in NANOGPT_FILES:
            shutil.copy(Path(args.nanogpt) / name, work / name)
        write_shakespeare_char(Path(args.shakespeare).read_text(), work / "data" / "shakespeare_char")
    else:
        shutil.copytree(examples / script, work)
    diffs = [HERE / script / "instrument.diff"] + ([HERE / script / f"{variant}.diff"] if variant != "original" else [])
    for diff in diffs:
        subprocess.run(["patch", "-s", "-p1", "-d", str(work), "-i", str(diff)], check=True)
    if script == "mnist":  # it reads ../data/MNIST/raw
        (work / "run").mkdir()
        (work / "data").symlink_to(Path(args.mnist).resolve())
    if script == "imagenet":  # it reads DIR/train and DIR/val
        folder = work / "cifar"
        folder.mkdir()
        (folder / "train").symlink_to((Path(args.cifar) / "train").resolve())
        (folder / "val").symlink_to((Path(args.cifar) / "test").resolve())
    return work


def write_shakespeare_char(text: str, folder: Path) -> None:
    """nanoGPT's data/shakespeare_char/prepare.py on ``text``: characters as token ids, the first 90%
    for training, train.bin / val.bin (uint16) and meta.pkl."""
    import pickle

    import numpy as np

    chars = sorted(set(text))
    ids = {ch: i for i, ch in enumerate(chars)}
    folder.mkdir(parents=True)
    cut = int(len(text) * 0.9)
    for name, part in (("train.bin", text[:cut]), ("val.bin", text[cut:])):
        np.array([ids[c] for c in part], dtype=np.uint16).tofile(folder / name)
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": ids}, f)


def launch(work: Path, script: str, variant: str, repeat: int, args, src: Path | None = None, **env_extra) -> dict:
    """Starts one variant's process (importing gpuaccel from ``src``, by default ``--src``);
    ``finish`` waits for it and reads what steptimer wrote."""
    arguments, steps = SCRIPTS[script]
    steps = args.steps or steps
    cifar = work / "cifar" if script == "imagenet" else Path(args.cifar).resolve() if args.cifar else ""
    command = [sys.executable] + [a.format(cifar=cifar, text=Path(args.text).resolve() if args.text else "")
                                  for a in arguments] + args.script_args.split()
    out = work / f"result-{repeat}.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(src or args.src), os.environ.get("PYTHONPATH", "")]),
           "STEPTIMER_WARMUP": str(args.warmup), "STEPTIMER_STEPS": str(steps), "STEPTIMER_OUT": str(out),
           "STEPTIMER_LABEL": f"{script}/{variant}", "PYTHONUNBUFFERED": "1", **env_extra}
    # the script's output goes to a file, not a pipe: a paired process whose pipe nobody reads
    # while the other is waited for would block on a full pipe, and its partner on the baton
    log = work / f"log-{repeat}.txt"
    with open(log, "w") as sink:
        process = subprocess.Popen(command, cwd=work / "run" if script == "mnist" else work, env=env,
                                   stdout=sink, stderr=subprocess.STDOUT)
    return {"process": process, "out": out, "log": log, "start": time.perf_counter(),
            "record": {"script": script, "variant": variant, "repeat": repeat, "command": " ".join(command[1:])}}


def finish(run: dict, timeout: float) -> dict:
    killed = ""
    try:
        run["process"].wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        run["process"].kill()
        run["process"].wait()
        killed = f"\n(killed after {timeout:.0f} s)"
    record = {**run["record"], "process_seconds": round(time.perf_counter() - run["start"], 2)}
    if run["out"].exists():
        record.update(json.loads(run["out"].read_text().splitlines()[-1]))
    else:
        record["error"] = (run["log"].read_text(errors="replace")[-2300:] + killed).strip()
    return record


def run_one(work: Path, script: str, variant: str, repeat: int, args) -> dict:
    return finish(launch(work, script, variant, repeat, args), args.timeout)


def run_pair(sides: list[dict], script: str, repeat: int, args) -> list[dict]:
    """Two sides at once, taking turns step by step (steptimer's paired mode); which one takes
    the first turn alternates from repeat to repeat. A side: its ``label`` (what its records
    are called: a variant, or a variant with one of two gpuaccel trees), ``variant``, ``work``
    folder and ``src``."""
    first, second = sides if repeat % 2 == 0 else sides[::-1]
    with tempfile.TemporaryDirectory() as folder:
        for name in ("first_to_second", "second_to_first"):
            os.mkfifo(Path(folder) / name)
        runs = [launch(side["work"], script, side["variant"], repeat, args, src=side["src"], STEPTIMER_PAIR=role,
                       STEPTIMER_PAIR_DIR=folder) for role, side in (("first", first), ("second", second))]
        deadline = time.perf_counter() + args.timeout
        while any(r["process"].poll() is None for r in runs) and time.perf_counter() < deadline:
            if any(r["process"].poll() is not None and not r["out"].exists() for r in runs):
                break  # one ended without a result: the other would wait for its turn for ever
            time.sleep(0.2)
        for run in runs:
            if run["process"].poll() is None:
                run["process"].kill()
        records = [finish(run, 10) for run in runs]
    for record, side in zip(records, (first, second)):
        record["variant"] = side["label"]
    return records


def neighbour_ratios(records: list[dict], variant: str) -> list[float]:
    """Each of ``variant``'s steps over the mean of the other variant's two steps either side of it
    (the turns interleave the two), as time ratios: under 1, ``variant``'s step was shorter."""
    first, second = sorted(records, key=lambda r: r["pair"] != "first")
    turns = [(name, t) for a, b in zip(first["step_seconds"], second["step_seconds"])
             for name, t in ((first["variant"], a), (second["variant"], b))]
    return [t / ((turns[j - 1][1] + turns[j + 1][1]) / 2) for j, (name, t) in enumerate(turns)
            if name == variant and 0 < j < len(turns) - 1]


def paired_summary(runs: list[dict], variants: list[str]) -> dict:
    """Per script: ``variants[1]``'s step time over its neighbours' (``variants[0]``), per repeat
    and over all, as medians with their 95% intervals; each variant's median step time."""
    table = {}
    for script in dict.fromkeys(r["script"] for r in runs):
        by_repeat = {}
        for r in runs:
            if r["script"] == script:
                by_repeat.setdefault(r["repeat"], []).append(r)
        pooled, rows = [], []
        for repeat, records in sorted(by_repeat.items()):
            if len(records) != 2 or any("error" in r for r in records):
                continue
            ratios = neighbour_ratios(records, variants[1])
            pooled += ratios
            rows.append({"repeat": repeat, "first": next(r["variant"] for r in records if r["pair"] == "first"),
                         "steps": len(ratios), "median": round(statistics.median(ratios), 4),
                         "median_95_interval": median_interval95(ratios)})
        step_ms = {}
        for v in variants:
            times = [t for r in runs if r["script"] == script and r["variant"] == v for t in r.get("step_seconds", [])]
            step_ms[v] = round(1e3 * statistics.median(times), 4) if times else None
        table[script] = {"time_over_neighbours": variants[1] + " / " + variants[0], "repeats": rows,
                         "all": {"steps": len(pooled), "median": round(statistics.median(pooled), 4),
                                 "median_95_interval": median_interval95(pooled)} if pooled else None,
                         "step_ms_median": step_ms}
    return table


def summary(runs: list[dict]) -> dict:
    """Per script and variant: samples/s of each round, their median, the ratio of medians to the
    original, and each round's own ratio (variants of one round ran minutes apart at most, so
    the machine's drift over the rounds cancels in it) with their median."""
    table = {}
    for script in dict.fromkeys(r["script"] for r in runs):
        rate = {(r["variant"], r["repeat"]): r.get("samples_per_second") for r in runs if r["script"] == script}
        rounds = sorted({repeat for _, repeat in rate})
        base = [rate.get(("original", k)) for k in rounds]
        table[script] = {}
        for variant in dict.fromkeys(v for v, _ in rate):
            values = [rate.get((variant, k)) for k in rounds]
            done = [v for v in values if v]
            row = {"samples_per_second": values, "median": statistics.median(done) if done else None}
            if any(base):
                row["vs_original"] = round(row["median"] / statistics.median([b for b in base if b]), 3) if done else None
                paired = [round(v / b, 3) for v, b in zip(values, base) if v and b]
                row["paired_vs_original"] = paired
                row["paired_median"] = statistics.median(paired) if paired else None
            table[script][variant] = row
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", help="a checkout of github.com/pytorch/examples")
    ap.add_argument("--nanogpt", help="a checkout of github.com/karpathy/nanoGPT (script nanogpt)")
    ap.add_argument("--shakespeare", help="tiny Shakespeare's input.txt (script nanogpt)")
    ap.add_argument("--cifar", help="CIFAR-10 image folder (train/, test/)")
    ap.add_argument("--mnist", help="folder holding MNIST/raw/")
    ap.add_argument("--text", help="folder with train.txt, valid.txt, test.txt")
    ap.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + EXTRA_VARIANTS)
    ap.add_argument("--script-args", default="", help="appended to every script's arguments (its parser "
                    "takes the last of a repeated option): e.g. '--batch_size 256 --epochs 40 --seed 2'")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=30, help="steps before the clock starts")
    ap.add_argument("--steps", type=int, help="timed steps of every script (default: each script's own)")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--paired", action="store_true",
                    help="run two --variants at once, taking turns step by step (steptimer.py's paired mode): "
                         "each step of the second over its neighbours of the first")
    ap.add_argument("--src", default=str(SRC), help="the gpuaccel source tree the ports import (default: this "
                    "checkout's src/; another one to compare two versions of gpuaccel)")
    ap.add_argument("--src-before", help="with --paired and one --variants: that variant with this gpuaccel tree "
                    "against it with --src's, step by step (a change to gpuaccel timed without the host's drift)")
    ap.add_argument("--out", help="write the results here (JSON)")
    args = ap.parse_args()
    args.src = Path(args.src).resolve()
    missing = [f"{s}/{v}.diff" for s in args.scripts for v in args.variants
               if v != "original" and not (HERE / s / f"{v}.diff").exists()]
    if missing:
        ap.error(f"no such variant here: {', '.join(missing)}")
    if "nanogpt" in args.scripts and not (args.nanogpt and args.shakespeare):
        ap.error("the nanogpt script needs --nanogpt and --shakespeare")
    if set(args.scripts) - {"nanogpt"} and not args.examples:
        ap.error("the pytorch/examples scripts need --examples")
    if args.src_before and not (args.paired and len(args.variants) == 1):
        ap.error("--src-before times one --variants with two gpuaccel trees: add --paired, name one variant")
    if args.paired and not args.src_before and len(args.variants) != 2:
        ap.error("--paired compares two --variants, e.g. --variants original port")
    examples = Path(args.examples or ".")
    results = {"gpuaccel_src": str(args.src), "examples_commit": (examples / "COMMIT").read_text().strip() if (examples / "COMMIT").exists()
               else None, "changed_lines": {}, "runs": []}
    if args.nanogpt and (Path(args.nanogpt) / "COMMIT").exists():
        results["nanogpt_commit"] = (Path(args.nanogpt) / "COMMIT").read_text().strip()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        works, sides = {}, {}
        for script in args.scripts:
            for variant in args.variants:
                works[script, variant] = prepare(examples, script, variant, root, args)
                if variant != "original":
                    results["changed_lines"][f"{script}/{variant}"] = changed_lines(HERE / script / f"{variant}.diff")
            if args.src_before:  # (the same variant twice, each in a folder of its own)
                variant, before = args.variants[0], root / "before"
                before.mkdir(exist_ok=True)
                sides[script] = [dict(label=f"{variant}@before", variant=variant, src=Path(args.src_before).resolve(),
                                      work=prepare(examples, script, variant, before, args)),
                                 dict(label=f"{variant}@after", variant=variant, src=args.src,
                                      work=works[script, variant])]
            else:
                sides[script] = [dict(label=v, variant=v, src=args.src, work=works[script, v]) for v in args.variants]
        for repeat in range(args.repeats):
            # each round starts with another variant: none always runs first (or last) in a round
            order = args.variants[repeat % len(args.variants):] + args.variants[:repeat % len(args.variants)]
            for script in args.scripts:
                if args.paired:
                    records = run_pair(sides[script], script, repeat, args)
                else:
                    records = [run_one(works[script, variant], script, variant, repeat, args) for variant in order]
                for record in records:
                    results["runs"].append(record)
                    print(json.dumps({k: v for k, v in record.items() if k != "step_seconds"}), flush=True)
    labels = [side["label"] for side in sides[args.scripts[0]]] if sides else args.variants
    results["summary"] = paired_summary(results["runs"], labels) if args.paired else summary(results["runs"])
    print(json.dumps(results["summary"]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
