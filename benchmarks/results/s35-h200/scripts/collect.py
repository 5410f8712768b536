"""Session 35: every run of calls 1-7 in one table (runs.json): img/s, the in-memory rate of the same
compile mode on the same machine and the share of it, per-epoch data wait and rates, warm-up.

Machines: calls 1-4 ran on one machine (A: each call found it warm), call 5 on B, calls 6-7 on C.
A run's compile mode is in its name (s35a.sh): ro = reduce-overhead (the step graph), rot = the step
graph with tuned kernels, tuned = --compile-mode tuned, otherwise default.

    python benchmarks/results/s35-h200/scripts/collect.py
"""
import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MACHINE = {"call1": "A", "call2": "A", "call3": "A", "call4": "A", "call5": "B", "call6": "C", "call7": "C"}
VARIANT = {"ro": "fused-bn-gram-graph", "rot": "fused-bn-gram-graph-tuned", "tuned": "fused-bn-gram-tuned",
           "default": "fused-bn-gram"}


def mode(run: str) -> str:
    tokens = run.split("_")
    return next((t for t in ("rot", "ro", "tuned") if t in tokens), "default")


in_memory: dict[tuple[str, str], list[float]] = {}  # (machine, variant) -> rates
for path in sorted(glob.glob(os.path.join(HERE, "call*", "memory_*.json"))):
    call = os.path.basename(os.path.dirname(path))
    for part in json.load(open(path))["parts"].values():
        in_memory.setdefault((MACHINE[call], part["variant"]), []).append(part["images_per_second"])

runs = []
for call in sorted(glob.glob(os.path.join(HERE, "call*"))):
    name = os.path.basename(call)
    for summary_path in sorted(glob.glob(os.path.join(call, "summary_*.json"))):
        key = os.path.basename(summary_path)[len("summary_"):-len(".json")]
        summary = json.load(open(summary_path))
        epochs = [json.loads(line) for line in open(os.path.join(call, f"metrics_{key}.jsonl"))]
        steps = json.load(open(os.path.join(call, f"steps_{key}.json")))[-180:]
        reference = in_memory.get((MACHINE[name], VARIANT[mode(key)]))
        rate = summary["images_per_second"]
        runs.append({
            "call": name, "machine": MACHINE[name], "run": key, "compile": mode(key),
            "images_per_second": rate, "in_memory_same_mode_same_machine": reference,
            "share_of_in_memory": [round(rate / r, 4) for r in reference] if reference else None,
            "jpeg_decoder": summary.get("jpeg_decoder"), "warmup_seconds": summary["warmup_seconds"],
            "data_wait_per_epoch": [e["data_wait"] for e in epochs],
            "images_per_second_per_epoch": [e["images_per_second"] for e in epochs],
            "host_ms_per_step_median": round(1e3 * statistics.median(steps), 1) if steps else None,
        })
json.dump({"in_memory": {f"{m} {v}": r for (m, v), r in sorted(in_memory.items())}, "runs": runs},
          open(os.path.join(HERE, "runs.json"), "w"), indent=1)
for (m, v), r in sorted(in_memory.items()):
    print("in memory", m, v, r)
for r in runs:
    print(r["call"], r["machine"], r["run"], r["images_per_second"], r["share_of_in_memory"], r["jpeg_decoder"],
          min(r["images_per_second_per_epoch"]))
