"""What copying a model's state from the GPU to the host and writing it cost, as a checkpoint,
model.pt and keeping the best weights do: into new pageable memory (``tensor.cpu()``), into
page-locked memory (allocating it, then each copy into it), and ``torch.save`` through
gpuaccel's atomic, fsynced write from pageable, page-locked and GPU tensors (and from pageable
ones with the zip records' CRC-32 checksums, which ``write_state`` leaves out).

    python benchmarks/cold_start/host_copies.py --mb 400 --mb 1200 --out host_copies.json

400 MB is GPT-2 small's weights as gpuaccel's gpt2-small recipe trains them (fp32, 20,319-token
vocabulary), 1,200 MB the same with AdamW's two moments (its checkpoint.pt).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone

import torch

from gpuaccel.files import atomic_write
from gpuaccel.runtime.state import write_state


def seconds(work) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    work()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(megabytes: int, repeats: int, folder: str) -> dict:
    tensors = [torch.randn(megabytes * 2**20 // 4 // 8, device="cuda") for _ in range(8)]  # (8 tensors, fp32)
    rows = {name: [] for name in ("cpu()", "page-locked: allocating", "page-locked: copying",
                                  "save: pageable", "save: page-locked", "save: from the GPU",
                                  "save: pageable, with checksums")}
    for _ in range(repeats):
        pageable, pinned = [], []
        rows["cpu()"].append(seconds(lambda: pageable.extend(t.cpu() for t in tensors)))
        rows["page-locked: allocating"].append(seconds(lambda: pinned.extend(
            torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)))
        rows["page-locked: copying"].append(seconds(lambda: [p.copy_(t, non_blocking=True)
                                                             for p, t in zip(pinned, tensors)]))
        for name, state in (("save: pageable", pageable), ("save: page-locked", pinned),
                            ("save: from the GPU", tensors)):
            rows[name].append(seconds(lambda: write_state(os.path.join(folder, "state.pt"), {"tensors": state})))
        rows["save: pageable, with checksums"].append(seconds(lambda: atomic_write(  # (torch.save's default)
            os.path.join(folder, "state.pt"), lambda f: torch.save({"tensors": pageable}, f))))
    return {name: {"median": round(statistics.median(v), 4), "min": round(min(v), 4), "max": round(max(v), 4)}
            for name, v in rows.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, action="append", required=True, help="megabytes of state (repeatable)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "seconds": {}}
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(args.out))) as folder:
        for mb in args.mb:
            result["seconds"][f"{mb} MB"] = measure(mb, args.repeats, folder)
            print(mb, "MB", json.dumps(result["seconds"][f"{mb} MB"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
