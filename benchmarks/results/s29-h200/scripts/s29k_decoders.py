"""Pillow's and nvJPEG's pixels of the JPEG CIFAR-10 folder, and cifar10-fast trained on each (seeds 1-5, in one process)."""
import json, os, statistics, sys, time
sys.path.insert(0, "benchmarks")
import numpy as np
import torch
import gpuaccel
from gpuaccel.train.recipes import load_recipe
from tune_recipe import run_seeds

spec = "/tmp/data/cifar10"
t = time.perf_counter(); pil = gpuaccel.load_dataset(spec); t_pil = time.perf_counter() - t
t = time.perf_counter(); nv = gpuaccel.load_dataset(spec, decode_device=torch.device("cuda")); t_nv = time.perf_counter() - t
out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "read_seconds": {"pil": t_pil, "nvjpeg": t_nv}}
for split in ("train", "test"):
    a = getattr(pil, f"{split}_images").astype(np.int16); b = getattr(nv, f"{split}_images").astype(np.int16)
    d = np.abs(a - b)
    out[split] = {"same_labels": bool(np.array_equal(getattr(pil, f"{split}_labels"), getattr(nv, f"{split}_labels"))),
                  "pixels_differing": float((d > 0).mean()), "mean_abs_difference": float(d.mean()),
                  "max_abs_difference": int(d.max()), "share_differing_by_more_than_2": float((d > 2).mean()),
                  "per_channel_mean_abs": [float(d[:, c].mean()) for c in range(3)]}
print(json.dumps(out), flush=True)
rows = {}
for name, ds in (("nvjpeg", nv), ("pil", pil)):
    runs = run_seeds(load_recipe("cifar10-fast"), spec, ds, {}, range(1, 6))
    rows[name] = {"accuracy": [r["test_accuracy"] for r in runs], "train_seconds": [r["train_seconds"] for r in runs]}
    rows[name]["mean"] = statistics.mean(rows[name]["accuracy"])
    print(name, json.dumps(rows[name]), flush=True)
out["cifar10_fast"] = rows
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "call11_decoders.json"), "w"), indent=1)
