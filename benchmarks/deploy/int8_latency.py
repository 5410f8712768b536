"""Batch-1 CPU latency of fp32 and int8 ONNX models under ONNX Runtime, across intra-op
thread counts and int8 formats, in one process (so the ratios compare like with like).

    python benchmarks/deploy/int8_latency.py RUN_DIR --out int8_latency.json

RUN_DIR is a gpuaccel run; its model is exported to ONNX and quantised (static, per
channel, calibrated on 512 training images) in QDQ and QOperator formats.

``--openvino`` adds the fp32 and QDQ int8 files run by OpenVINO (gpuaccel's ``--runtime
openvino``: f32 precision hint, LATENCY hint), at the same thread counts.

``--profile-ops`` adds, for each model and thread count, where a call's time goes: ONNX
Runtime's profiler's kernel time per operator type (microseconds per call, summed over the
nodes of that type), from a separate profiled session so the latencies stay unprofiled.
"""

import argparse
import collections
import json
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process

from gpuaccel.bench.timing import host_times_ms
from gpuaccel.deploy import export, load_trained
from gpuaccel.deploy.quantize import calibration_sample
from gpuaccel.deploy.runners import openvino_runner, openvino_version


def latency_ms(path: Path, threads: int, x: np.ndarray, calls: int = 400, runtime: str = "onnxruntime") -> float:
    if runtime == "openvino":
        call = openvino_runner(path, threads=threads)
    else:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        call = lambda x: session.run(None, {name: x})  # noqa: E731
    return statistics.median(host_times_ms(lambda: call(x), calls, warmup=50))


def op_times_us(path: Path, threads: int, x: np.ndarray, calls: int = 200) -> dict:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.enable_profiling = True
    options.profile_file_prefix = str(path.with_suffix("")) + f"-t{threads}"
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    for _ in range(calls):
        session.run(None, {name: x})
    per_op = collections.Counter()
    for event in json.loads(Path(session.end_profiling()).read_text()):
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            per_op[event["args"]["op_name"]] += event["dur"]
    # the profile also holds the session's first run (graph set-up), so divide by calls + 1
    return {op: round(us / (calls + 1), 1) for op, us in per_op.most_common()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile-ops", action="store_true", help="also record kernel time per operator type")
    ap.add_argument("--openvino", action="store_true", help="also time the fp32 and QDQ int8 files in OpenVINO")
    args = ap.parse_args()
    trained = load_trained(args.run_dir)
    data = trained.load_data(None, "no data")
    calib = calibration_sample(data.train_images, 512).astype(np.float32) / 255.0
    work = Path(tempfile.mkdtemp())
    fp32 = export(trained, "onnx", work / "model.onnx", dynamic_batch=True)
    prepared = work / "prepared.onnx"
    quant_pre_process(str(fp32), str(prepared), skip_symbolic_shape=True)
    name = ort.InferenceSession(str(fp32), providers=["CPUExecutionProvider"]).get_inputs()[0].name

    class Reader:
        def __init__(self):
            self.batches = iter([{name: calib[i:i + 32]} for i in range(0, len(calib), 32)])

        def get_next(self):
            return next(self.batches, None)

    models = {"fp32": fp32}
    for fmt in ("QDQ", "QOperator"):
        out = work / f"int8-{fmt}.onnx"
        quantize_static(str(prepared), str(out), Reader(), quant_format=getattr(QuantFormat, fmt), per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
        models[f"int8-{fmt}"] = out
    x = np.random.default_rng(0).random((1, trained.in_channels, trained.image_size, trained.image_size),
                                        dtype=np.float32)
    rows = []
    cores = os.cpu_count() or 1
    for threads in sorted({t for t in (1, 2, 4, 8, cores) if t <= cores}):  # never more threads than cores
        row = {"threads": threads}
        for label, path in models.items():
            row[label] = latency_ms(path, threads, x)
        for label in models:
            if label != "fp32":
                row[f"ratio_{label}"] = row["fp32"] / row[label]
        if args.openvino:
            row["openvino-fp32"] = latency_ms(fp32, threads, x, runtime="openvino")
            row["openvino-int8-QDQ"] = latency_ms(models["int8-QDQ"], threads, x, runtime="openvino")
            row["ratio_openvino-int8-QDQ"] = row["openvino-fp32"] / row["openvino-int8-QDQ"]
            row["ratio_onnxruntime-fp32_to_openvino-int8-QDQ"] = row["fp32"] / row["openvino-int8-QDQ"]
        if args.profile_ops:
            row["op_us_per_call"] = {label: op_times_us(path, threads, x) for label, path in models.items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"cpu_count": os.cpu_count(), "onnxruntime": ort.__version__,
                                          "openvino": openvino_version() if args.openvino else None,
                                          "model": trained.model_name, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
