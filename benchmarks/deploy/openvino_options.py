"""Batch-1 CPU latency of an fp32 and an int8 ONNX file in OpenVINO under the settings that
could matter, in one process: the batch dimension left dynamic or fixed at 1, the number of
threads, and (fp32 only) the bf16 precision hint, which OpenVINO uses by default on CPUs with
bf16 instructions. Then where an int8 call's time goes, from OpenVINO's per-node performance
counters, summed by execution type (which kernel: AMX, VNNI, reference).

    python benchmarks/deploy/openvino_options.py MODEL.onnx MODEL.int8.onnx --out openvino_options.json

The calls use OpenVINO's tensor API as gpuaccel's runner does (``set_input_tensor``, ``infer``).
"""

import argparse
import collections
import json
import os
import statistics
from pathlib import Path

import numpy as np
import openvino as ov

from gpuaccel.bench.timing import host_times_ms


def compile_model(path: str, threads: int, static: bool, precision: str = "f32", profile: bool = False):
    core = ov.Core()
    model = core.read_model(path)
    if static:
        model.reshape([1, *model.inputs[0].partial_shape[1:].to_shape()])
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": threads,
              "PERF_COUNT": profile}
    return core.compile_model(model, "CPU", config)


def call_for(compiled, x):
    request = compiled.create_infer_request()

    def call():
        request.set_input_tensor(ov.Tensor(x, shared_memory=True))
        request.infer()
        return request.get_output_tensor().data
    return request, call


def latency_ms(compiled, x, calls: int = 400) -> dict:
    times = host_times_ms(call_for(compiled, x)[1], calls, warmup=50)
    return {"p50": statistics.median(times), "p10": float(np.percentile(times, 10)),
            "p90": float(np.percentile(times, 90))}


def where_time_goes(compiled, x, calls: int = 200) -> dict:
    request, call = call_for(compiled, x)
    for _ in range(20):
        call()
    by_kernel, by_node_type, total = collections.Counter(), collections.Counter(), 0.0
    for _ in range(calls):
        call()
        for node in request.profiling_info:
            us = node.real_time.total_seconds() * 1e6
            by_kernel[node.exec_type] += us / calls
            by_node_type[node.node_type] += us / calls
            total += us / calls
    rounded = lambda c: {k: round(v, 1) for k, v in c.most_common(12) if v >= 0.5}  # noqa: E731
    return {"total_us": round(total, 1), "by_exec_type_us": rounded(by_kernel), "by_node_type_us": rounded(by_node_type)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("fp32")
    ap.add_argument("int8")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    x = np.random.default_rng(0).random((1, *ov.Core().read_model(args.fp32).inputs[0].partial_shape[1:].to_shape()),
                                        dtype=np.float32)
    rows = []
    for threads in sorted({t for t in (1, 2, 4, 8, cores) if t <= cores}):
        for static in (False, True):
            row = {"threads": threads, "batch": "fixed at 1" if static else "dynamic"}
            for label, path in (("fp32", args.fp32), ("int8", args.int8)):
                row[label] = latency_ms(compile_model(path, threads, static), x)
            row["ratio"] = row["fp32"]["p50"] / row["int8"]["p50"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    bf16 = {static: latency_ms(compile_model(args.fp32, cores, static, "bf16"), x) for static in (False, True)}
    print("fp32 file, bf16 hint:", json.dumps(bf16), flush=True)
    profiles = {f"{label}, batch {'fixed' if static else 'dynamic'}, {cores} threads":
                where_time_goes(compile_model(path, cores, static, profile=True), x)
                for label, path in (("fp32", args.fp32), ("int8", args.int8)) for static in (False, True)}
    for name, profile in profiles.items():
        print(name, json.dumps(profile), flush=True)
    Path(args.out).write_text(json.dumps({"cpu_count": cores, "openvino": ov.__version__.split("-")[0], "rows": rows,
                                          "fp32_file_bf16_hint_ms": {"dynamic": bf16[False], "fixed": bf16[True]},
                                          "profiles": profiles}, indent=2) + "\n")


if __name__ == "__main__":
    main()
