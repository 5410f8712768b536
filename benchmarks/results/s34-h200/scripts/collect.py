"""Session 34: every run of calls 1-5 in one table (runs.json): img/s, share of the call's in-memory
rate, per-epoch data wait and rates, warm-up, host seconds per step (STEPLOG, last 180 steps).

    python benchmarks/results/s34-h200/scripts/collect.py
"""
import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
runs, in_memory = [], None
for call in sorted(glob.glob(os.path.join(HERE, "call*"))):
    memory = sorted(glob.glob(os.path.join(call, "memory_*.json")))
    if memory:  # (call 4 has none: it ran on call 3's machine, whose rate stands)
        in_memory = next(iter(json.load(open(memory[0]))["parts"].values()))["images_per_second"]
    for summary_path in sorted(glob.glob(os.path.join(call, "summary_*.json"))):
        key = os.path.basename(summary_path)[len("summary_"):-len(".json")]
        summary = json.load(open(summary_path))
        epochs = [json.loads(line) for line in open(os.path.join(call, f"metrics_{key}.jsonl"))]
        steps = json.load(open(os.path.join(call, f"steps_{key}.json")))[-180:]
        rate = summary["images_per_second"]
        runs.append({
            "call": os.path.basename(call), "run": key, "images_per_second": rate, "in_memory": in_memory,
            "share_of_in_memory": round(rate / in_memory, 4) if in_memory else None,
            "jpeg_decoder": summary.get("jpeg_decoder"), "warmup_seconds": summary["warmup_seconds"],
            "data_wait_per_epoch": [e["data_wait"] for e in epochs],
            "images_per_second_per_epoch": [e["images_per_second"] for e in epochs],
            "host_ms_per_step_median": round(1e3 * statistics.median(steps), 1) if steps else None,
        })
json.dump(runs, open(os.path.join(HERE, "runs.json"), "w"), indent=1)
for r in runs:
    print(r["call"], r["run"], r["images_per_second"], r["share_of_in_memory"], r["jpeg_decoder"])
