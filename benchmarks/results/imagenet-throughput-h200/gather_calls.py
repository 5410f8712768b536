"""Writes FOLDER/runs.json from FOLDER's call folders (the A/B calls of fused-resample/ and
per-image-taps/): per call the code, the in-memory reference, the resampler's GPU times, and per
run img/s, share of in memory, per-epoch img/s and data wait; where logged, the full garbage
collections (gc_KEY.json), the pipeline thread's time per batch (prod_KEY.json: median, p90 and
mean ms after the first 20 batches) and a profile's summary (gaps_KEY.json). Run from the
repository root:

    python3 benchmarks/results/imagenet-throughput-h200/gather_calls.py fused-resample 891b52a
    python3 benchmarks/results/imagenet-throughput-h200/gather_calls.py per-image-taps 28d7588
"""
import glob
import json
import os
import statistics
import sys

SETTINGS = {"switch1ms": "SWITCH=0.001", "files": "SHARING=file_system", "both": "SWITCH=0.001 SHARING=file_system",
            "yuv": "YUV=1 (timing probe, wrong colours)", "depth6": "DEPTH=6", "ro_rgb": "--compile-mode reduce-overhead",
            "ro_yuv": "--compile-mode reduce-overhead, YUV=1", "new_profile": "--profile",
            "long_profile": "--profile, 12 steps from step 20 (PROFILE_STEPS=12)",
            "freeze": "this tree (gc.collect and gc.freeze after the warm-up)",
            "nofreeze": "this tree with gc.freeze a no-op (NO_FREEZE=1; the gc.collect stays)",
            "nodecode": "ablation: each loader's first batch decoded once, resampled for every batch (NODECODE=1)",
            "noresample": "ablation: every batch decoded, the first finished batch handed out again (NORESAMPLE=1)",
            "nogpu": "ablation: both (NODECODE=1 NORESAMPLE=1): files read and handed over, no pipeline GPU work",
            "own": "training on a stream of its own, nvJPEG given the default stream (OWNSTREAM=1)",
            "noreserve": "this tree without the reserve of nvJPEG's buffers (NORESERVE=1)"}
SKIPPED_BATCHES = 20  # the warm-up's and the first epoch's start


def pipeline_times(path: str) -> dict:
    spans = json.load(open(path))
    summary = {}
    for name, seconds in spans.items():
        ms = sorted(s * 1e3 for s in seconds[SKIPPED_BATCHES:])
        if ms:
            summary[name] = {"batches": len(ms), "median_ms": round(statistics.median(ms), 2),
                             "p90_ms": round(ms[int(0.9 * len(ms))], 2), "mean_ms": round(statistics.mean(ms), 2)}
    return summary


def gather(folder: str, head: str) -> dict:
    out = {"device": "NVIDIA H200, driver 580.159.04, 16-core host", "torch": "2.11.0+cu130", "date": "2026-11-23",
           "head_commit": head, "calls": {}}
    for call in sorted(glob.glob(f"{folder}/call*")):
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
            if os.path.exists(f"{call}/prod_{key}.json"):
                run["pipeline_thread_per_batch"] = pipeline_times(f"{call}/prod_{key}.json")
            if os.path.exists(f"{call}/gaps_{key}.json"):
                run["profile"] = json.load(open(f"{call}/gaps_{key}.json"))
            entry["runs"][key] = run
        out["calls"][name] = entry
    return out


if __name__ == "__main__":
    name, head = sys.argv[1:3]
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    with open(f"{folder}/runs.json", "w") as f:
        json.dump(gather(folder, head), f, indent=1)
