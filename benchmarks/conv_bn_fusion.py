"""Whether cuDNN's fused convolution graphs would pay for ResNet-50's batch norms (issue 7 (b)).

gpuaccel's compiled ResNet-50 step spends more time in inductor's kernels, mostly batch norm,
than in its convolutions (benchmarks/results/resnet50-kernels-h200/README.md): every batch norm reads
the convolution's output once for its statistics, again to normalise it, and twice more in
the backward pass. cuDNN's graph API can fuse those passes into the convolutions themselves, as
NVIDIA's MLPerf ResNet-50 does: the statistics computed in the convolution's epilogue
(``genstats``), and the previous batch norm's scale, bias and ReLU applied in its prologue, in
the forward pass and again in the weight gradient's.

For each convolution of gpuaccel's ResNet-50 at 224 px (batch 256, bf16, channels_last;
the stem excepted), this times on a GPU:

  conv            cuDNN's convolution alone: the floor
  unfused         what torch.compile runs now: the previous batch norm's scale, bias and ReLU
                  (a pointwise kernel, for the convolutions whose input is a batch norm's
                  output), cuDNN's convolution, the per-channel sum and sum of squares of its
                  output (a reduction kernel)
  fused           one cuDNN graph: scale-bias-ReLU, convolution, statistics
  wgrad           the weight gradient from the normalised input, as now
  wgrad_fused     one cuDNN graph: scale-bias-ReLU on the input, then the weight gradient

and sums each over the step (each shape times its count). A graph cuDNN cannot run is reported
with its error. ``--validate-only`` builds and validates every graph without a GPU (the
frontend's checks of shapes and types), to try the script on a CPU machine.

    pip install nvidia-cudnn-frontend==1.16.0   # or its wheel, offline
    python benchmarks/conv_bn_fusion.py --out conv_bn_fusion.json

(Frontend 1.16: its later versions need cuda-python and CUTLASS's Python DSL even to validate
a graph.)
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 256
IMAGE = 224
MAX_PLANS = 8


def convolutions(batch: int = BATCH, image: int = IMAGE) -> list[dict]:
    """The distinct convolutions of gpuaccel's ResNet-50 after its stem, with how often each
    runs per step and whether its input is a batch norm's ReLU output (the second and third of
    a bottleneck) or a block's output (the first, and the shortcut)."""
    from gpuaccel.models import create_model
    from gpuaccel.models.layers import SpaceToDepthConv2d

    model = create_model("resnet50", num_classes=1000, image_size=image).to("meta")
    seen: collections.Counter = collections.Counter()

    def record(name):
        def hook(conv, inputs, output):
            x = inputs[0]
            prologue = name.endswith(("conv2.0", "conv3.0"))
            key = (x.shape[1], conv.out_channels, conv.kernel_size[0], conv.stride[0], conv.padding[0],
                   x.shape[2], x.shape[3], prologue)
            seen[key] += 1
        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d) and not isinstance(module, SpaceToDepthConv2d):
            module.register_forward_hook(record(name))
    with torch.no_grad():
        model(torch.empty(batch, 3, image, image, device="meta"))
    return [dict(zip(("in_ch", "out_ch", "kernel", "stride", "padding", "height", "width", "prologue"), key),
                 count=count) for key, count in seen.items()]


def channels_last(shape, device, dtype=torch.bfloat16, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, device=device) * scale).to(dtype).contiguous(memory_format=torch.channels_last)


class Unit:
    """One convolution's tensors at batch ``batch``: input, weights, the previous batch norm's
    per-channel scale and bias, and the output's gradient."""

    def __init__(self, shape: dict, batch: int, device):
        self.shape = shape
        c, k, r = shape["in_ch"], shape["out_ch"], shape["kernel"]
        self.x = channels_last((batch, c, shape["height"], shape["width"]), device)
        self.w = channels_last((k, c, r, r), device, scale=(2 / (c * r * r)) ** 0.5)
        self.scale = channels_last((1, c, 1, 1), device, scale=0.5).abs_()
        self.bias = channels_last((1, c, 1, 1), device, scale=0.1)
        out_hw = (shape["height"] + 2 * shape["padding"] - r) // shape["stride"] + 1
        self.y_shape = (batch, k, out_hw, out_hw)
        self.dy = channels_last(self.y_shape, device)

    @property
    def stride(self):
        return self.shape["stride"]

    @property
    def padding(self):
        return self.shape["padding"]

    def prologue(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * self.scale + self.bias) if self.shape["prologue"] else x


def unfused_forward(unit: Unit):
    """The forward unit as torch.compile makes it now."""
    stride, padding, prologue = unit.stride, unit.padding, unit.prologue
    torch._dynamo.reset()  # each shape compiled afresh: past dynamo's recompile limit it would run eagerly

    def forward(x, w):
        y = F.conv2d(prologue(x), w, stride=stride, padding=padding)
        y32 = y.float()
        return y, y32.sum((0, 2, 3)), (y32 * y32).sum((0, 2, 3))
    return torch.compile(forward, dynamic=False)


def cudnn_graph(handle, build):
    """A cuDNN graph in bf16 with fp32 arithmetic, built by ``build(graph)`` (which returns the
    tensors to bind), with every execution plan cuDNN can build for it; without a handle, only
    validated."""
    import cudnn

    graph = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    tensors = build(graph)
    graph.validate()
    if handle is not None:
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans(cudnn.build_plan_policy.ALL)
    return graph, tensors


def _input(graph, unit: Unit, x, tensors: dict):
    """The convolution's input in ``graph``: ``x``, or scale-bias-ReLU of it (its scale and bias
    tensors then added to ``tensors``)."""
    if not unit.shape["prologue"]:
        return x
    tensors["scale"], tensors["bias"] = _like(graph, "scale", unit.scale), _like(graph, "bias", unit.bias)
    scaled = graph.scale(name="mul_scale", input=x, scale=tensors["scale"])
    return graph.relu(name="relu", input=graph.bias(name="add_bias", input=scaled, bias=tensors["bias"]))


def _like(graph, name, tensor):
    return graph.tensor(name=name, dim=list(tensor.shape), stride=list(tensor.stride()), data_type=tensor.dtype)


def fused_forward_graph(handle, unit: Unit):
    import cudnn

    def build(graph):
        tensors = {"x": _like(graph, "x", unit.x), "w": _like(graph, "w", unit.w)}
        y = graph.conv_fprop(image=_input(graph, unit, tensors["x"], tensors), weight=tensors["w"],
                             padding=[unit.padding] * 2, stride=[unit.stride] * 2, dilation=[1, 1], name="conv")
        y.set_output(True).set_data_type(cudnn.data_type.BFLOAT16)
        total, squares = graph.genstats(name="stats", input=y)
        total.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        squares.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        return {**tensors, "y": y, "sum": total, "squares": squares}
    return cudnn_graph(handle, build)


def fused_wgrad_graph(handle, unit: Unit):
    import cudnn

    def build(graph):
        tensors = {"x": _like(graph, "x", unit.x), "dy": _like(graph, "dy", unit.dy)}
        dw = graph.conv_wgrad(image=_input(graph, unit, tensors["x"], tensors), loss=tensors["dy"],
                              padding=[unit.padding] * 2, stride=[unit.stride] * 2, dilation=[1, 1], name="wgrad")
        dw.set_output(True).set_dim(list(unit.w.shape)).set_stride(list(unit.w.stride())) \
            .set_data_type(cudnn.data_type.BFLOAT16)
        return {**tensors, "dw": dw}
    return cudnn_graph(handle, build)


def fastest_plan(graph, pack: dict, handle, repeats: int, check) -> dict:
    """Times each of the graph's first ``MAX_PLANS`` plans (as cudnn.benchmark does for
    PyTorch's convolutions) and returns the fastest's times, plan 0's (heuristics' first
    choice), and ``check()`` of the fastest's outputs after one run and after two (equal if the
    outputs are written, not added to)."""
    count = min(graph.get_execution_plan_count(), MAX_PLANS)
    workspace = torch.empty(max([graph.get_workspace_size_plan_at_index(i) for i in range(count)] + [1]),
                            device="cuda", dtype=torch.uint8)
    timed, failed = {}, {}
    for index in range(count):
        def run(index=index):
            graph.execute_plan_at_index(pack, workspace, index, handle=handle)
        try:
            timed[index] = median_ms(run, repeats)
        except Exception as exc:  # a plan that did not build or run
            failed[index] = f"{type(exc).__name__}: {exc}"[:200]
    if not timed:
        return {"error": f"none of {count} plans ran", "plans_failed": failed}
    best = min(timed, key=lambda i: timed[i]["ms"])
    graph.execute_plan_at_index(pack, workspace, best, handle=handle)
    once = check()
    graph.execute_plan_at_index(pack, workspace, best, handle=handle)
    return {**timed[best], "plan": best, "plans": count, "plans_failed": len(failed),
            "heuristic_ms": timed.get(0, {}).get("ms"), "error_once": once, "error_twice": check()}


def median_ms(fn, repeats: int, inner: int = 10) -> dict:
    """Milliseconds per call of ``fn``: CUDA-event timings of ``inner`` calls in a row (so that
    the GPU does not wait for the host between calls), median and range of ``repeats``."""
    from gpuaccel.bench.timing import cuda_times_ms

    def calls():
        for _ in range(inner):
            fn()
    times = [t / inner for t in cuda_times_ms(calls, repeats=repeats, warmup=2)]
    return {"ms": round(statistics.median(times), 4), "min": round(min(times), 4), "max": round(max(times), 4)}


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def fused(make_graph, handle, unit: Unit, buffers: dict, repeats: int, check) -> dict:
    """The fastest plan of ``make_graph``'s graph for ``unit``, or why there was none."""
    buffers = {**buffers, "scale": unit.scale, "bias": unit.bias}
    try:
        graph, tensors = make_graph(handle, unit)
        return fastest_plan(graph, {tensors[name]: buffers[name] for name in tensors}, handle, repeats, check)
    except Exception as exc:  # a graph cuDNN declines: recorded, the other measurements still run
        return {"error": f"{type(exc).__name__}: {exc}"[:400]}


def measure(shape: dict, handle, repeats: int) -> dict:
    unit = Unit(shape, BATCH, "cuda")
    row = dict(shape)
    conv = lambda: F.conv2d(unit.x, unit.w, stride=unit.stride, padding=unit.padding)  # noqa: E731
    row["conv"] = median_ms(conv, repeats)
    compiled = unfused_forward(unit)
    y_ref, sum_ref, sq_ref = compiled(unit.x, unit.w)
    row["unfused"] = median_ms(lambda: compiled(unit.x, unit.w), repeats)
    out = {"y": torch.empty_like(y_ref), "sum": torch.zeros_like(sum_ref).view(1, -1, 1, 1),
           "squares": torch.zeros_like(sq_ref).view(1, -1, 1, 1)}

    def forward_error():
        torch.cuda.synchronize()
        return {"y": close(out["y"], y_ref), "sum": close(out["sum"].flatten(), sum_ref),
                "squares": close(out["squares"].flatten(), sq_ref)}
    row["fused"] = fused(fused_forward_graph, handle, unit, {"x": unit.x, "w": unit.w, **out}, repeats,
                         forward_error)

    z = unit.prologue(unit.x).contiguous(memory_format=torch.channels_last)
    wgrad = lambda: torch.ops.aten.convolution_backward(  # noqa: E731
        unit.dy, z, unit.w, None, [unit.stride] * 2, [unit.padding] * 2, [1, 1], False, [0, 0], 1,
        [False, True, False])[1]
    dw_ref = wgrad()
    row["wgrad"] = median_ms(wgrad, repeats)
    dw = torch.empty_like(unit.w)

    def wgrad_error():
        torch.cuda.synchronize()
        return close(dw, dw_ref)
    row["wgrad_fused"] = fused(fused_wgrad_graph, handle, unit, {"x": unit.x, "dy": unit.dy, "dw": dw}, repeats,
                               wgrad_error)
    return row


def totals(rows: list[dict]) -> dict:
    """Per-step milliseconds of each way, over the shapes where every way ran."""
    keys = ("conv", "unfused", "fused", "wgrad", "wgrad_fused")
    ok = [r for r in rows if all("ms" in r.get(k, {}) for k in keys)]
    return {"shapes": len(ok), "of": len(rows),
            **{k: round(sum(r[k]["ms"] * r["count"] for r in ok), 3) for k in keys}}


def validate_only(shapes: list[dict]) -> list[dict]:
    rows = []
    for shape in shapes:
        unit = Unit(shape, BATCH, "meta")
        row = dict(shape)
        for name, make in (("fused", fused_forward_graph), ("wgrad_fused", fused_wgrad_graph)):
            try:
                make(None, unit)
                row[name] = "valid"
            except Exception as exc:
                row[name] = f"{type(exc).__name__}: {exc}"[:400]
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--validate-only", action="store_true")
    args = ap.parse_args()
    import cudnn

    shapes = convolutions()
    result = {"torch": torch.__version__, "cudnn_frontend": getattr(cudnn, "__version__", None),
              "cudnn_backend": cudnn.backend_version_string(), "batch": BATCH, "image": IMAGE}
    if args.validate_only:
        result["rows"] = validate_only(shapes)
        for row in result["rows"]:
            print(row, flush=True)
    else:
        torch.backends.cudnn.benchmark = True
        result["device"] = torch.cuda.get_device_name()
        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        rows = []
        for shape in shapes:
            start = time.perf_counter()
            row = measure(shape, handle, args.repeats)
            row["seconds"] = round(time.perf_counter() - start, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
            result["rows"] = rows
            result["per_step_ms"] = totals(rows)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        print("per step", result["per_step_ms"], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
