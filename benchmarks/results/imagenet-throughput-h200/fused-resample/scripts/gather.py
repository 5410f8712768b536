"""Writes ../runs.json from the call folders: per call the code, the in-memory reference, the
resampler's GPU times, and per run img/s, share of in memory, per-epoch img/s and data wait
(and, where logged, the full garbage collections). Run from the repository root."""
import glob
import json
import os

D = "benchmarks/results/imagenet-throughput-h200/fused-resample"
SETTINGS = {"switch1ms": "SWITCH=0.001", "files": "SHARING=file_system", "both": "SWITCH=0.001 SHARING=file_system",
            "yuv": "YUV=1 (timing probe, wrong colours)", "depth6": "DEPTH=6", "ro_rgb": "--compile-mode reduce-overhead",
            "ro_yuv": "--compile-mode reduce-overhead, YUV=1", "new_profile": "--profile",
            "freeze": "this tree (gc.collect and gc.freeze after the warm-up)",
            "nofreeze": "this tree with gc.freeze a no-op (NO_FREEZE=1; the gc.collect stays)"}
out = {"device": "NVIDIA H200, driver 580.159.04, 16-core host", "torch": "2.11.0+cu130", "date": "2026-11-23",
       "head_commit": "891b52a", "calls": {}}
for call in sorted(glob.glob(f"{D}/call*")):
    name = os.path.basename(call)
    entry = {"code": open(f"{call}/machine.txt").read().split("\n")[1].strip(), "runs": {}}
    memory = None
    if os.path.exists(f"{call}/memory.json"):
        phases = json.load(open(f"{call}/memory.json"))["memory"]
        entry["in_memory"] = {k: v["images_per_second"] for k, v in phases.items()}
        memory = next(v["images_per_second"] for k, v in phases.items() if k.startswith("gpuaccel"))
    if os.path.exists(f"{call}/resample.json"):
        variants = json.load(open(f"{call}/resample.json"))["variants"]
        entry["resample_gpu_ms_median"] = {k: v["median_ms"] for k, v in variants.items()}
    for summary in sorted(glob.glob(f"{call}/summary_*.json")):
        key = os.path.basename(summary)[len("summary_"):-len(".json")]
        metrics = [json.loads(line) for line in open(f"{call}/metrics_{key}.jsonl")]
        run = {"images_per_second": json.load(open(summary))["images_per_second"]}
        prefix = key.rsplit("_r", 1)[0]
        if prefix in SETTINGS:
            run["setting"] = SETTINGS[prefix]
        if memory:
            reference = "share_of_in_memory_reduce_overhead" if key.startswith("ro_") else "share_of_in_memory"
            run[reference] = round(run["images_per_second"] / memory, 4)
        run["epoch_images_per_second"] = [m["images_per_second"] for m in metrics]
        run["epoch_data_wait"] = [m["data_wait"] for m in metrics]
        if os.path.exists(f"{call}/gc_{key}.json"):
            run["full_gc_seconds_since_start_and_ms"] = json.load(open(f"{call}/gc_{key}.json"))
        entry["runs"][key] = run
    out["calls"][name] = entry
with open(f"{D}/runs.json", "w") as f:
    json.dump(out, f, indent=1)
