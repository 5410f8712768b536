"""bench-infer's int8 row against the bare session, in one process: the product's int8 models
(per tensor, as bench-infer makes them, and per channel) timed through a bare ONNX Runtime
session at every core and through bench-infer's runner and timer.

    python benchmarks/results/int8-latency-cpu2/same_process_check.py RUN_DIR --out check.json
(from the repository root)
"""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, "benchmarks")
from int8_latency import latency_ms  # noqa: E402

from gpuaccel.deploy import export, load_trained  # noqa: E402
from gpuaccel.deploy.bench import measure  # noqa: E402
from gpuaccel.deploy.quantize import calibration_sample, quantize_int8  # noqa: E402
from gpuaccel.deploy.runners import load_runner  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("run_dir")
ap.add_argument("--out", required=True)
args = ap.parse_args()
trained = load_trained(args.run_dir)
calibration = calibration_sample(trained.load_data(None, "no data").train_images, 256)
work = Path(tempfile.mkdtemp())
fp32 = export(trained, "onnx", work / "model.onnx", dynamic_batch=True)
models = {"fp32": fp32}
for per_channel in (False, True):
    label = f"int8-{'per-channel' if per_channel else 'per-tensor'}"
    models[label] = quantize_int8(fp32, work / f"{label}.onnx", calibration, per_channel=per_channel)
    (work / f"{label}.onnx.json").write_text((work / "model.onnx.json").read_text())
x = np.random.default_rng(0).random((1, 3, trained.image_size, trained.image_size), dtype=np.float32)
make_input = lambda b: np.random.rand(b, 3, trained.image_size, trained.image_size).astype(np.float32)  # noqa: E731
result = {"cpu_count": os.cpu_count(), "bare_session_ms": {}, "bench_infer_runner_ms": {}}
for label, path in models.items():
    result["bare_session_ms"][label] = latency_ms(path, os.cpu_count(), x, 200)
    result["bench_infer_runner_ms"][label] = measure(load_runner(path), make_input, batches=())["latency_p50_ms"]
print(json.dumps(result, indent=1))
Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
