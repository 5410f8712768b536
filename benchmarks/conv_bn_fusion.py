"""Whether cuDNN's fused convolution graphs pay for ResNet-50's batch norms (issue 7 (b)), one
convolution at a time.

gpuaccel's compiled ResNet-50 step spends more time in inductor's kernels, mostly batch norm,
than in its convolutions (benchmarks/results/resnet50-kernels-h200/README.md).
models/conv_bn_stats.py moves that work into cuDNN's convolution kernels. For each distinct
convolution of gpuaccel's ResNet-50 at 224 px (batch 256, bf16, channels_last; the stem
excepted) this times, on a GPU, its three graphs against what torch.compile runs now:

  conv                 cuDNN's convolution alone: the floor
  forward              now: the previous batch norm's scale, shift and ReLU (a pointwise kernel,
                       for the convolutions whose input is a batch norm's output), cuDNN's
                       convolution, the per-channel sum and sum of squares (a reduction);
                       fused: one graph (conv2d_stats)
  weight_grad          now: the weight gradient from the normalised input;
                       fused (with a prologue): the scale-shift-ReLU applied as it loads (one graph)
  prologue_grad        now: the input gradient, through the ReLU, and its two per-channel sums;
                       fused: one graph (the sums in the input gradient's epilogue)

with the largest differences, and the per-step totals (each shape times its count). A graph
cuDNN declines is listed with its reason and its fused time is PyTorch's. ``--validate-only``
builds every graph and runs the cuDNN frontend's checks of it, without a GPU.

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


class Unit:
    """One convolution's tensors: input, weights, the previous batch norm's per-channel scale
    and shift (fp32, or None without a prologue), and a gradient of the output."""

    def __init__(self, shape: dict, batch: int, device):
        self.shape, self.stride, self.padding = shape, shape["stride"], shape["padding"]
        c, k, r = shape["in_ch"], shape["out_ch"], shape["kernel"]
        self.x = channels_last((batch, c, shape["height"], shape["width"]), device)
        self.w = channels_last((k, c, r, r), device, scale=(2 / (c * r * r)) ** 0.5)
        self.scale = torch.rand(c, device=device) + 0.5 if shape["prologue"] else None
        self.shift = torch.randn(c, device=device) * 0.1 if shape["prologue"] else None
        side = (shape["height"] + 2 * self.padding - r) // self.stride + 1
        self.grad = channels_last((batch, k, side, side), device)


def channels_last(shape, device, dtype=torch.bfloat16, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, device=device) * scale).to(dtype).contiguous(memory_format=torch.channels_last)


def compiled(fn):
    torch._dynamo.reset()  # each shape compiled afresh: past dynamo's recompile limit it would run eagerly
    return torch.compile(fn, dynamic=False)


def median_ms(fn, repeats: int, inner: int = 10) -> dict:
    """Milliseconds per call of ``fn``: CUDA-event timings of ``inner`` calls in a row (so that
    the GPU does not wait for the host between calls), median and range of ``repeats``."""
    from gpuaccel.bench.timing import cuda_times_ms

    def calls():
        for _ in range(inner):
            fn()
    times = [t / inner for t in cuda_times_ms(calls, repeats=repeats, warmup=2)]
    return {"ms": round(statistics.median(times), 4), "min": round(min(times), 4), "max": round(max(times), 4)}


def difference(got, expected) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    got, expected = got.float(), expected.float()
    return round(float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12)), 5)


def measure(shape: dict, repeats: int) -> dict:
    """Each part now (PyTorch's operators, compiled) and fused (gpuaccel's custom operators)."""
    from gpuaccel.models.conv_bn_stats import (_prologue, conv2d_prologue_grad, conv2d_stats, conv2d_weight_grad,
                                               reference_forward, reference_prologue_grad, reference_weight_grad)

    u = Unit(shape, BATCH, "cuda")
    row = dict(shape)
    args = (u.stride, u.padding)
    row["conv"] = median_ms(lambda: F.conv2d(u.x, u.w, stride=u.stride, padding=u.padding), repeats)

    now = compiled(lambda x, w: reference_forward(x, w, u.scale, u.shift, *args))
    expected = now(u.x, u.w)
    got = conv2d_stats(u.x, u.w, u.scale, u.shift, *args)
    row["forward"] = {"now": median_ms(lambda: now(u.x, u.w), repeats),
                      "fused": median_ms(lambda: conv2d_stats(u.x, u.w, u.scale, u.shift, *args), repeats),
                      "difference": [difference(g, e) for g, e in zip(got, expected)]}

    # now the normalised input is saved for the weight gradient: no prologue to apply
    z = _prologue(u.x, u.scale, u.shift).contiguous(memory_format=torch.channels_last)
    weight_grad_now = lambda: reference_weight_grad(z, u.w, None, None, u.grad, *args)  # noqa: E731
    row["weight_grad"] = {"now": median_ms(weight_grad_now, repeats)}
    if u.scale is not None:  # without a prologue gpuaccel keeps PyTorch's weight gradient
        row["weight_grad"].update(
            fused=median_ms(lambda: conv2d_weight_grad(u.x, u.w, u.scale, u.shift, u.grad, *args), repeats),
            difference=difference(conv2d_weight_grad(u.x, u.w, u.scale, u.shift, u.grad, *args), weight_grad_now()))
        now = compiled(lambda x, w, grad: reference_prologue_grad(x, w, u.scale, u.shift, grad, *args))
        expected = now(u.x, u.w, u.grad)
        got = conv2d_prologue_grad(u.x, u.w, u.scale, u.shift, u.grad, *args)
        row["prologue_grad"] = {
            "now": median_ms(lambda: now(u.x, u.w, u.grad), repeats),
            "fused": median_ms(lambda: conv2d_prologue_grad(u.x, u.w, u.scale, u.shift, u.grad, *args), repeats),
            "difference": [difference(g, e) for g, e in zip(got, expected)]}
    return row


def totals(rows: list[dict]) -> dict:
    """Per-step milliseconds of each part, now and fused (where a part is not fused, its time
    now)."""
    out = {"conv": round(sum(r["conv"]["ms"] * r["count"] for r in rows), 3)}
    for part in ("forward", "weight_grad", "prologue_grad"):
        for way in ("now", "fused"):
            out[f"{part}_{way}"] = round(sum(r[part].get(way, r[part]["now"])["ms"] * r["count"]
                                             for r in rows if part in r), 3)
    return out


def validate_only(shapes: list[dict]) -> list[dict]:
    """Every graph of every shape through the cuDNN frontend's checks, on meta tensors."""
    from gpuaccel.models.conv_bn_stats import _output, validate_graphs

    rows = []
    for shape in shapes:
        u = Unit(shape, BATCH, "meta")
        y = _output(u.x, u.w, u.stride, u.padding)
        vector = lambda n: torch.empty(n, device="meta")  # noqa: E731
        affine = {} if u.scale is None else {"scale": u.scale, "shift": u.shift}
        graphs = {"forward": dict(x=u.x, w=u.w, y=y, sum=vector(y.shape[1]), squares=vector(y.shape[1]), **affine),
                  "weight_grad": dict(x=u.x, grad=u.grad, dw=torch.empty_like(u.w), **affine)}
        if affine:
            graphs["prologue_grad"] = dict(x=u.x, w=u.w, grad=u.grad, grad_pre=torch.empty_like(u.x),
                                           sum_by_x=vector(u.x.shape[1]), sum=vector(u.x.shape[1]), **affine)
        row = dict(shape)
        for kind, buffers in graphs.items():
            try:
                validate_graphs(kind, buffers, u.stride, u.padding)
                row[kind] = "valid"
            except Exception as exc:
                row[kind] = f"{type(exc).__name__}: {exc}"[:400]
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--validate-only", action="store_true")
    args = ap.parse_args()
    from gpuaccel.models.conv_bn_stats import cudnn_frontend, summary

    cudnn = cudnn_frontend()
    if cudnn is None:
        sys.exit("needs NVIDIA's cuDNN frontend: pip install nvidia-cudnn-frontend==1.16.0")
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
        rows = []
        for shape in shapes:
            start = time.perf_counter()
            row = measure(shape, args.repeats)
            row["seconds"] = round(time.perf_counter() - start, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
            result.update(rows=rows, per_step_ms=totals(rows), graphs=summary())
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        print("per step", result["per_step_ms"], "\ngraphs", result["graphs"], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
