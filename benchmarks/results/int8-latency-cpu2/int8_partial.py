"""Does keeping the late, small-image convolutions in fp32 make the int8 ResNet-18 faster at
batch 1? (ONNX Runtime's int8 convolution splits its work over output pixels only, and the last
stages of a 32 px ResNet-18 have 64 and 16 of them.)

    PYTHONPATH=src python benchmarks/results/int8-latency-cpu2/int8_partial.py --out int8_partial.json

An untrained gpuaccel ResNet-18, calibrated on random images (compare the variants with each
other, not with the trained model's timings elsewhere); per-channel static QDQ int8 with the convolutions whose output is at most N px wide
left in fp32; median of 300 batch-1 calls after 50 warm-ups, every variant at each thread
count in one process.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process

from gpuaccel.models import create_model


def latency_ms(path, threads, x, name):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    for _ in range(50):
        session.run(None, {name: x})
    times = []
    for _ in range(300):
        start = time.perf_counter()
        session.run(None, {name: x})
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    model = create_model("resnet18", num_classes=10, in_channels=3, image_size=32).eval()
    torch.onnx.export(model, (torch.rand(1, 3, 32, 32),), str(work / "fp32.onnx"), dynamo=True, external_data=False,
                      dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    prepared = work / "prepared.onnx"
    quant_pre_process(str(work / "fp32.onnx"), str(prepared), skip_symbolic_shape=True)
    graph = onnx.shape_inference.infer_shapes(onnx.load(str(prepared))).graph
    widths = {v.name: v.type.tensor_type.shape.dim[-1].dim_value for v in graph.value_info}
    convs = [(n.name, widths[n.output[0]]) for n in graph.node if n.op_type == "Conv"]
    name = graph.input[0].name
    calibration = np.random.default_rng(0).random((64, 3, 32, 32), dtype=np.float32)

    class Batches(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{name: calibration[i:i + 16]} for i in range(0, 64, 16)])

        def get_next(self):
            return next(self.batches, None)

    models = {"fp32": work / "fp32.onnx"}
    for keep_fp32_up_to in (0, 4, 8):
        out = work / f"int8-fp32-up-to-{keep_fp32_up_to}px.onnx"
        quantize_static(str(prepared), str(out), Batches(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        nodes_to_exclude=[n for n, width in convs if width <= keep_fp32_up_to])
        models[f"int8, convolutions <= {keep_fp32_up_to} px in fp32" if keep_fp32_up_to else "int8"] = out
    x = np.random.default_rng(1).random((1, 3, 32, 32), dtype=np.float32)
    rows = []
    for threads in sorted({1, 2, os.cpu_count() or 1}):
        row = {"threads": threads, **{label: latency_ms(path, threads, x, name) for label, path in models.items()}}
        print(json.dumps(row), flush=True)
        rows.append(row)
    Path(args.out).write_text(json.dumps({"cpu_count": os.cpu_count(), "onnxruntime": ort.__version__,
                                          "torch": torch.__version__, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
