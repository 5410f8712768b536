"""Inference speed of one trained model on every backend available here.

Batch-1 latency (p50/p90/p99 over timed single-image calls after warm-up; GPU calls end
with a synchronisation, so the time is the whole call) and best-batch throughput (the
fastest of a few batch sizes, images per second).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from ..bench.timing import measure
from ..errors import GpuaccelError
from .artifact import TrainedModel
from .export import export
from .quantize import convert_fp16, quantize_int8
from .runners import cuda_provider, load_runner, onnx_has_cuda, openvino_version


def torch_call(module, device, dtype=None):
    """``call(x)`` for a PyTorch module: no autograd, optional autocast, synchronised on GPUs
    (so the host clock times the whole call)."""
    @torch.no_grad()
    def call(x):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            out = module(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out
    return call


def onnx_cuda_call(path: Path, device: torch.device, cuda_graph: bool = False):
    """``call(x)`` for an ONNX file in onnxruntime-gpu, ``x`` a contiguous float32 CUDA tensor.

    Inputs and outputs are bound to GPU memory, so a call costs what the PyTorch GPU rows' calls
    cost: no copies through the host. onnxruntime runs on its own stream, so torch's is
    synchronised first. Each input shape gets its own session; with ``cuda_graph`` its captured
    graph reads a fixed input buffer that each call copies ``x`` into.
    """
    import onnxruntime as ort

    provider = cuda_provider(device, cuda_graph)
    bound = {}  # shape -> [session, binding, bound input, output, input name]

    def bind_input(binding, name, x):
        binding.bind_input(name, "cuda", x.device.index, np.float32, list(x.shape), x.data_ptr())

    def new_session(x):
        # no run before binding: a CUDA-graph session captures its first run, buffers included
        session = ort.InferenceSession(str(path), providers=[provider])
        name, out_name = session.get_inputs()[0].name, session.get_outputs()[0].name
        classes = session.get_outputs()[0].shape[1]  # gpuaccel's exports fix the class count
        x_bound = torch.empty_like(x) if cuda_graph else x
        y = torch.empty(len(x), classes, device=x.device)
        binding = session.io_binding()
        bind_input(binding, name, x_bound)
        binding.bind_output(out_name, "cuda", y.device.index, np.float32, list(y.shape), y.data_ptr())
        return [session, binding, x_bound, y, name]

    def call(x):
        if tuple(x.shape) not in bound:
            bound[tuple(x.shape)] = new_session(x)
        entry = bound[tuple(x.shape)]
        session, binding, x_bound, y, name = entry
        if cuda_graph:
            x_bound.copy_(x)
        elif x.data_ptr() != x_bound.data_ptr():
            bind_input(binding, name, x)
            entry[2] = x  # the binding holds a raw pointer: keep the tensor alive
        torch.cuda.current_stream(device).synchronize()
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        return y
    return call


def backends(trained: TrainedModel, calibration: np.ndarray | None, workdir: Path, threads: int | None = None):
    """Yields (name, call, input maker) for every backend this machine has."""
    c, s = trained.in_channels, trained.image_size
    cpu_input = lambda b: torch.rand(b, c, s, s)  # noqa: E731
    module = trained.module.eval()
    yield "pytorch-cpu-fp32", torch_call(module, torch.device("cpu")), cpu_input
    try:
        onnx_path = export(trained, "onnx", workdir / "model.onnx", dynamic_batch=True)
    except Exception as exc:  # noqa: BLE001 -- report and carry on with the other backends
        yield "onnxruntime-cpu-fp32", exc, None
        onnx_path = None
    else:
        np_input = lambda b: np.random.rand(b, c, s, s).astype(np.float32)  # noqa: E731
        int8 = None
        if calibration is not None:
            int8 = quantize_int8(onnx_path, workdir / "model.int8.onnx", calibration)
            (workdir / "model.int8.onnx.json").write_text((workdir / "model.onnx.json").read_text())
        for runtime in ("onnxruntime", "openvino") if openvino_version() else ("onnxruntime",):
            yield f"{runtime}-cpu-fp32", load_runner(onnx_path, threads=threads, runtime=runtime), np_input
            if int8 is not None:
                yield f"{runtime}-cpu-int8", load_runner(int8, threads=threads, runtime=runtime), np_input
    if onnx_path is not None and torch.cuda.is_available():
        if onnx_has_cuda():
            device = torch.device("cuda")
            nchw_input = lambda b: torch.rand(b, c, s, s, device=device)  # noqa: E731
            fp16 = convert_fp16(onnx_path, workdir / "model.fp16.onnx")
            yield "onnxruntime-cuda-fp32", onnx_cuda_call(onnx_path, device), nchw_input
            yield "onnxruntime-cuda-fp16", onnx_cuda_call(fp16, device), nchw_input
            yield "onnxruntime-cuda-fp16-cuda-graphs", onnx_cuda_call(fp16, device, cuda_graph=True), nchw_input
        else:
            yield "onnxruntime-cuda", GpuaccelError("this onnxruntime has no CUDA provider (pip install "
                                                    "'gpuaccel[deploy-gpu]')"), None
    if torch.cuda.is_available():
        device = torch.device("cuda")
        gpu = trained.module.to(device).to(memory_format=torch.channels_last)
        gpu_input = lambda b: torch.rand(b, c, s, s, device=device).to(memory_format=torch.channels_last)  # noqa: E731
        yield "pytorch-cuda-fp32", torch_call(gpu, device), gpu_input
        yield "pytorch-cuda-bf16", torch_call(gpu, device, torch.bfloat16), gpu_input
        graphs = torch.compile(gpu, mode="reduce-overhead")
        yield "pytorch-cuda-bf16-compiled-cuda-graphs", torch_call(graphs, device, torch.bfloat16), gpu_input
        # bf16 weights instead of autocast: no cast kernels in the call, which matters at batch 1
        import copy

        bf16 = copy.deepcopy(gpu).to(torch.bfloat16)
        bf16_graphs = torch.compile(bf16, mode="reduce-overhead")
        bf16_input = lambda b: gpu_input(b).to(torch.bfloat16)  # noqa: E731
        yield "pytorch-cuda-bf16-weights-compiled-cuda-graphs", torch_call(bf16_graphs, device), bf16_input


def bench_inference(trained: TrainedModel, calibration: np.ndarray | None, repeats: int = 200,
                    threads: int | None = None) -> dict:
    """The machine and one row per backend. ``threads`` limits the CPU backends' threads
    (small models at batch 1 are often fastest on a few)."""
    from ..device import cpu_name

    if threads:
        torch.set_num_threads(threads)
    return {"model": trained.model_name, "image_size": trained.image_size, "cpu": cpu_name(),
            "cpu_threads": torch.get_num_threads(), "onnxruntime_threads": threads or "default (all cores)",
            "openvino": openvino_version(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "rows": _rows(trained, calibration, repeats, threads)}


def _rows(trained: TrainedModel, calibration: np.ndarray | None, repeats: int, threads: int | None) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, call, make_input in backends(trained, calibration, Path(tmp), threads):
            if isinstance(call, Exception):
                rows.append({"backend": name, "error": f"{type(call).__name__}: {str(call)[:200]}"})
                continue
            rows.append({"backend": name, **measure(call, make_input, repeats=repeats)})
    return rows
