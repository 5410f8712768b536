"""A detector's post-processing on the host, alone: class-wise NMS, boxes scaled to each image's
size and the rows of the detections table, for one chunk of frames (4,096 by default) of
synthetic top-k detections; two source trees alternated, each round in its own process.

    python benchmarks/infer_memory/postprocess.py --old SRC_BEFORE --new src --rounds 3 --out results.json

Each round runs the three steps ``--repeats`` times on the same data and reports the median; the
rows themselves are hashed, so the trees are seen to write the same table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ONE_TREE = r"""
import hashlib, json, sys, time
import torch
from gpuaccel.deploy import vision

frames, top_k, repeats = (int(a) for a in sys.argv[1:4])
g = torch.Generator().manual_seed(0)
xy = torch.rand(frames, top_k, 2, generator=g) * 110
size = 4 + 12 * torch.rand(frames, top_k, 2, generator=g)
scores = torch.rand(frames, top_k, generator=g).pow(8).sort(1, descending=True).values  # a few above 0.3 each
classes = torch.randint(0, 10, (frames, top_k), generator=g).float()
decoded = torch.cat([xy, xy + size, scores[..., None], classes[..., None]], -1).numpy()
sizes = [tuple(s) for s in torch.randint(64, 640, (frames, 2), generator=g).tolist()]
names = [f"/frames/{i:07d}.jpg" for i in range(frames)]
seconds = []
for _ in range(repeats):
    start = time.perf_counter()
    kept = vision.scaled_to_images(vision.kept_detections(decoded, 0.3, 0.5), sizes, (128, 128))
    rows = vision.detections_table(names, kept, [str(c) for c in range(10)])
    seconds.append(time.perf_counter() - start)
rows = [tuple(r.values()) if isinstance(r, dict) else tuple(r) for r in rows]  # (older trees: dicts)
print(json.dumps({"seconds": sorted(seconds)[len(seconds) // 2], "boxes": len(rows),
                  "rows_md5": hashlib.md5(repr(rows).encode()).hexdigest()}))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", default="src")
    ap.add_argument("--frames", type=int, default=4096)
    ap.add_argument("--top-k", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    trees = {"old": str(Path(args.old).resolve()), "new": str(Path(args.new).resolve())}
    rows = []
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            done = subprocess.run([sys.executable, "-c", ONE_TREE, str(args.frames), str(args.top_k), str(args.repeats)],
                                  env={**os.environ, "PYTHONPATH": trees[name]}, capture_output=True, text=True,
                                  check=True)
            rows.append({"tree": name, "round": r, **json.loads(done.stdout.strip().splitlines()[-1])})
            print(json.dumps(rows[-1]), flush=True)
    medians = {name: statistics.median(x["seconds"] for x in rows if x["tree"] == name) for name in trees}
    import torch
    meta = {"machine": platform.processor() or "cpu", "cores": os.cpu_count(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "median_seconds": medians,
                                          "old_over_new": medians["old"] / medians["new"]}, indent=2))
    print(f"median seconds per {args.frames} frames: old {medians['old']:.3f}, new {medians['new']:.3f}, "
          f"{medians['old'] / medians['new']:.2f}x")


if __name__ == "__main__":
    main()
