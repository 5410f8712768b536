"""ONNX Runtime on a GPU: which CUDA-provider settings make an exported model fastest?

    PYTHONPATH=src python benchmarks/deploy/onnx_gpu_options.py MODEL.onnx [MODEL.fp16.onnx ...] --out onnx_gpu_options.json

Needs onnxruntime-gpu. For each model and each setting, in one process: batch-1 latency
(median and p90 of 300 calls after 50 warm-ups; every call ends with its output ready) and
the throughput at batch 256. Settings:

- ``numpy``: numpy in and out, as ``gpuaccel infer`` calls it (copies to and from the GPU
  are inside each call);
- ``io-binding``: input and output bound to GPU memory, so a call is the model alone;
- ``io-binding+nhwc``: the same with the provider's ``prefer_nhwc`` (channels-last kernels);
- ``io-binding+cuda-graph``: the provider's ``enable_cuda_graph`` (one graph replay a call);
- ``io-binding+nhwc+cuda-graph``: both.

The model takes 3-channel images and any batch size (``gpuaccel export --dynamic-batch``); each
CUDA-graph session is captured at one batch size.
"""

import argparse
import json
import statistics

import numpy as np
import torch  # noqa: F401 -- loads the CUDA 13 and cuDNN libraries that onnxruntime-gpu links against
import onnxruntime as ort  # noqa: E402, I001

from gpuaccel.bench.timing import host_times_ms

SETTINGS = {
    "numpy": ({}, False),
    "io-binding": ({}, True),
    "io-binding+nhwc": ({"prefer_nhwc": "1"}, True),
    "io-binding+cuda-graph": ({"enable_cuda_graph": "1"}, True),
    "io-binding+nhwc+cuda-graph": ({"prefer_nhwc": "1", "enable_cuda_graph": "1"}, True),
}


def make_call(path: str, options: dict, bound: bool, x: np.ndarray):
    session = ort.InferenceSession(path, providers=[("CUDAExecutionProvider", options), "CPUExecutionProvider"])
    assert "CUDAExecutionProvider" in session.get_providers(), "the CUDA provider did not start"
    name, out_name = session.get_inputs()[0].name, session.get_outputs()[0].name
    if not bound:
        return lambda: session.run(None, {name: x})[0]
    binding = session.io_binding()
    x_gpu = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    # no run before binding: a CUDA-graph session captures its first run, buffers included
    classes = session.get_outputs()[0].shape[-1]
    y_gpu = ort.OrtValue.ortvalue_from_shape_and_type([len(x), classes], np.float32, "cuda", 0)
    binding.bind_ortvalue_input(name, x_gpu)
    binding.bind_ortvalue_output(out_name, y_gpu)

    def call():
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
    return call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    s = args.image_size
    rows = []
    for path in args.models:
        for setting, (options, bound) in SETTINGS.items():
            row = {"model": path, "setting": setting}
            try:
                one = make_call(path, options, bound, rng.random((1, 3, s, s), dtype=np.float32))
                single = host_times_ms(one, 300, warmup=50)
                row["batch1_p50_ms"] = statistics.median(single)
                row["batch1_p90_ms"] = float(np.percentile(single, 90))
                big = make_call(path, options, bound, rng.random((256, 3, s, s), dtype=np.float32))
                row["batch256_images_per_second"] = 256 / (statistics.median(host_times_ms(big, 30, warmup=5)) / 1000)
            except Exception as exc:  # noqa: BLE001 -- a setting this build lacks is a result, not a crash
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"onnxruntime": ort.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
