"""`gpuaccel infer` on folders of N JPEG frames: the process's peak memory (max RSS) and frames per
second of the whole command, against N; two source trees alternated where ``--old`` is given.

    python benchmarks/infer_memory/infer_memory.py --run runs/RUN --counts 2000 20000 --size 64 \
        [--old /tmp/old/src] --new src --out results.json

The frames are made once (random textures, JPEG quality 90, ``--size`` px square, in ``--work``);
each measurement is ``python -m gpuaccel infer RUN FRAMES --out CSV --force`` in its own process
(``--device`` passed on), its peak resident memory read from the kernel (``os.wait4``), its wall
time from the host clock. Memory that does not grow with N is what streaming inputs promise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def make_frames(folder: Path, count: int, size: int) -> Path:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    have = len(list(folder.glob("*.jpg")))
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    for i in range(have, count):
        Image.fromarray(np.roll(base, i, axis=(i % 2))).save(folder / f"{i:07d}.jpg", quality=90)
    return folder


def run_infer(src: str, run: str, frames: Path, count: int, out: Path, device: str, batch: int) -> dict:
    env = {**os.environ, "PYTHONPATH": src}
    cmd = [sys.executable, "-m", "gpuaccel", "infer", run, str(frames), "--out", str(out), "--force",
           "--device", device, "--batch-size", str(batch)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    rows = sum(1 for _ in open(out)) - 1  # (a classifier's: one per frame; a detector's: one per object found)
    return {"max_rss_mib": round(usage.ru_maxrss / 1024, 1), "seconds": round(seconds, 2),
            "frames_per_second": round(count / seconds, 1), "rows": rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True, help="a run directory of an image model (classifier or detector)")
    ap.add_argument("--counts", type=int, nargs="+", default=[5000, 50000])
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--source", help="a folder of JPEGs to make the frames of (each used in turn), e.g. a "
                    "detector's own validation images, so that it finds objects; default: random textures")
    ap.add_argument("--new", default="src")
    ap.add_argument("--old", help="another source tree, alternated with --new")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--work", default="/tmp/infer_memory")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    work = Path(args.work)
    trees = {"new": str(Path(args.new).resolve())}
    if args.old:
        trees = {"old": str(Path(args.old).resolve()), **trees}
    rows = []
    sources = sorted(Path(args.source).rglob("*.jpg")) if args.source else None
    for count in args.counts:
        frames = make_frames(work / f"frames_{args.size}", count, args.size) if sources is None else None
        subset = work / f"frames_{args.size if sources is None else 'source'}_{count}"
        if not subset.exists():  # (a folder of exactly N frames: links to the first N, or to --source's in turn)
            subset.mkdir(parents=True)
            for i in range(count):
                os.symlink(frames / f"{i:07d}.jpg" if sources is None else sources[i % len(sources)].resolve(),
                           subset / f"{i:07d}.jpg")
        for repeat in range(args.repeats):
            for name, src in trees.items():
                result = run_infer(src, args.run, subset, count, work / "predictions.csv", args.device,
                                   args.batch_size)
                row = {"tree": name, "frames": count, "repeat": repeat, **result}
                rows.append(row)
                print(json.dumps(row), flush=True)
    meta = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu"
            else platform.processor() or "cpu", "cores": os.cpu_count(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "size": None if args.source else args.size, "source": args.source,
            "batch_size": args.batch_size,
            "command": " ".join(sys.argv)}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    for name in trees:
        mine = [r for r in rows if r["tree"] == name]
        print(name, ", ".join(f"{r['frames']:,} frames: {r['max_rss_mib']:,.0f} MiB, {r['frames_per_second']:,.0f}/s"
                              for r in mine))


if __name__ == "__main__":
    main()
