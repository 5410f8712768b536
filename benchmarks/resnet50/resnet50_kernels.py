"""Where gpuaccel's compiled ResNet-50 training step (224 px, batch 256, bf16, channels_last)
spends its GPU time, kernel by kernel, and what single changes to it are worth.

Parts (each runs in a child process of its own, because cuDNN's and inductor's settings are
global):

  kernels    every kernel of a step from torch.profiler, GPU ms per step, and the cuDNN
             convolutions' time by input shape (kernels-plain: the same with PyTorch's stem
             convolution and max pooling; kernels-fused-bn-gram: with the widening 1x1 convolutions'
             statistics from their inputs' Gram matrices)
  bandwidth  the kernels part, with the GB each inductor kernel must move by inductor's own
             reckoning, and so its GB/s: which ones run far below the memory bandwidth
  convs      each distinct convolution of the model alone: forward, input gradient and weight
             gradient, TFLOP/s, with cuDNN trying its default 10 algorithms or all of them
  layers     the stem convolution and the max pooling alone, each way
  variants   the whole step under single changes (see VARIANTS)

    python benchmarks/resnet50/resnet50_kernels.py --parts layers variants kernels bandwidth --out kernels.json

--batch sets the images per step of every part (a variant's own "batch" still wins).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 256
CLASSES = 1000


# What each turns off or on, against gpuaccel as it is, except that the batch norms stay in their
# own passes unless a variant says "fused_bn" (models/layers.py FOLD_BATCH_NORMS off): gpuaccel's
# default is the variant fused-bn-gram
VARIANTS = {
    "default": {},
    "plain-stem": {"plain_stem": True},
    "plain-max-pool": {"plain_max_pool": True},
    "plain-stem-and-max-pool": {"plain_stem": True, "plain_max_pool": True},
    "cudnn-all-algorithms": {"cudnn_benchmark_limit": 0},
    "reduce-overhead": {"mode": "reduce-overhead"},
    "autotune-pointwise": {"inductor": {"max_autotune_pointwise": True}},
    "coordinate-descent": {"inductor": {"coordinate_descent_tuning": True}},
    # inductor's reduction schedules, for the batch-norm statistics that run at 1.5-2.5 TB/s
    "mix-order-reduction": {"inductor": {"triton.mix_order_reduction": True}},
    "cooperative-reductions": {"inductor": {"triton.cooperative_reductions": True}},
    "combo-kernels": {"inductor": {"combo_kernels": True}},
    # only the widening 1x1 convolutions, their batch norms folded in, the statistics from their
    # inputs' Gram matrices (models/layers.py, ConvBatchNormAct.gram_forward)
    "fused-bn-gram": {"fused_bn": "gram"},
    "fused-bn-gram-tuned": {"fused_bn": "gram", "mode": "tuned"},
    "fused-bn-gram-batch-512-tuned": {"fused_bn": "gram", "mode": "tuned", "batch": 512},
    # the whole training step as one CUDA graph (the Trainer's step graph), inductor's default
    # kernels or tuned ones (--compile-mode reduce-overhead [--tune-kernels])
    "fused-bn-gram-graph": {"fused_bn": "gram", "mode": "reduce-overhead"},
    "fused-bn-gram-graph-tuned": {"fused_bn": "gram", "mode": "reduce-overhead", "tune_kernels": True},
    # The 1x1 convolutions as matrix products that inductor may generate itself, with the batch
    # norm's pointwise work fused into their loads and stores: in the forward pass only
    # (inductor's own conversion) or in both passes (linear-1x1: written as F.linear).
    # "ATEN" keeps the other convolutions on cuDNN, where Triton's templates are slower and
    # their search would not fit the compile budget.
    "conv-1x1-as-mm": {"inductor": {"conv_1x1_as_mm": True}},
    "autotune-gemm": {"inductor": {"max_autotune_gemm": True, "max_autotune_conv_backends": "ATEN"}},
    "linear-1x1": {"linear_1x1": True},
    "linear-1x1-autotune-gemm": {"linear_1x1": True,
                                 "inductor": {"max_autotune_gemm": True, "max_autotune_conv_backends": "ATEN"}},
    "linear-1x1-autotune-gemm-tuned": {"linear_1x1": True,
                                       "inductor": {"max_autotune_gemm": True, "max_autotune_conv_backends": "ATEN",
                                                    "coordinate_descent_tuning": True}},
    # more images per step: larger convolutions for cuDNN, the same bytes per image for batch norm
    "batch-384": {"batch": 384},
    "batch-512": {"batch": 512},
    "batch-768": {"batch": 768},
    # inductor fuses nodes that share no memory reads, fewer kernels over the same bytes
    "aggressive-fusion": {"inductor": {"aggressive_fusion": True}},
    "tuned": {"mode": "tuned"},
    "batch-512-tuned": {"batch": 512, "mode": "tuned"},
}


def conv_1x1_as_linear(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` for a 1x1 convolution over a channels_last ``x``, written as a matrix
    product over its (N, H, W, C) view, so that autograd's backward is two more of them."""
    if conv.stride != (1, 1):
        x = x[:, :, ::conv.stride[0], ::conv.stride[1]]
    out = F.linear(x.permute(0, 2, 3, 1), conv.weight.flatten(1), conv.bias)
    return out.permute(0, 3, 1, 2)


def use_linear_1x1() -> None:
    """Every later 1x1 convolution without padding or groups runs as :func:`conv_1x1_as_linear`."""
    conv_forward = nn.Conv2d.forward

    def forward(self, x):
        if self.kernel_size == (1, 1) and self.padding in ((0, 0), 0) and self.groups == 1 \
                and x.is_contiguous(memory_format=torch.channels_last):
            return conv_1x1_as_linear(self, x)
        return conv_forward(self, x)
    nn.Conv2d.forward = forward


def build_step(mode: str = "default", plain_stem: bool = False, plain_max_pool: bool = False,
               linear_1x1: bool = False, fused_bn: str = "off", tune_kernels: bool = False):
    """gpuaccel's Trainer on one synthetic in-memory batch, as in imagenet_throughput.py's
    memory phase; returns a function of no arguments that runs one training step. ``plain_*``
    put back the stem convolution and max pooling of PyTorch; ``linear_1x1`` writes the 1x1
    convolutions as matrix products; ``fused_bn`` "gram" folds the widening 1x1 convolutions'
    batch norms in (models/layers.py, FOLD_BATCH_NORMS), "off" leaves every batch norm its pass."""
    from gpuaccel.models import layers
    from gpuaccel.models.layers import SpaceToDepthConv2d, TritonMaxPool2d
    from imagenet_throughput import gpuaccel_step

    if plain_stem:
        SpaceToDepthConv2d.forward = nn.Conv2d.forward
    if plain_max_pool:
        TritonMaxPool2d.forward = nn.MaxPool2d.forward
    if linear_1x1:
        use_linear_1x1()
    layers.FOLD_BATCH_NORMS = fused_bn == "gram"
    x = torch.randn(BATCH, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, CLASSES, (BATCH,), device="cuda")
    return gpuaccel_step(mode, CLASSES, x, y, tune_kernels=tune_kernels)


def timed(step, steps: int = 10, repeats: int = 7) -> dict:
    from gpuaccel.bench.timing import cuda_times_ms

    times = cuda_times_ms(lambda: [step() for _ in range(steps)], repeats=repeats, warmup=2)
    rates = [steps * BATCH / (t / 1000) for t in times]
    return {"images_per_second": round(statistics.median(rates), 1), "min": round(min(rates), 1),
            "max": round(max(rates), 1), "ms_per_step": round(statistics.median(times) / steps, 3)}


def warm(step) -> float:
    start = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    return round(time.perf_counter() - start, 1)


def part_kernels(plain: bool, steps: int = 5, bandwidth: bool = False, fused_bn: str = "off") -> dict:
    """Every kernel's GPU ms per step, and the convolutions' by input shape. With ``bandwidth``,
    also the bytes inductor reckons each of its kernels must move (``kernel_num_gb``, written
    into the kernels' source when ``benchmark_kernel`` is set) and so each one's GB/s."""
    import glob
    import re

    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile

    if bandwidth:
        inductor_config.benchmark_kernel = True
    torch.backends.cudnn.benchmark = True
    step = build_step(plain_stem=plain, plain_max_pool=plain, fused_bn=fused_bn)
    compile_seconds = warm(step)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels: dict[str, list] = {}
    for event in prof.events():
        # "## Call CompiledFxGraph ##" ranges are annotations over other kernels, not kernels
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith("##"):
            row = kernels.setdefault(event.name, [0, 0.0])
            row[0] += 1
            row[1] += event.device_time
    table = sorted(([name, calls / steps, us / 1000 / steps] for name, (calls, us) in kernels.items()),
                   key=lambda r: -r[2])
    gigabytes = {}
    if bandwidth:
        pattern = re.compile(r"'kernel_name': '(\w+)'.*?'kernel_num_gb': ([0-9.e+-]+)", re.S)
        for path in glob.glob(os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "**", "*.py"), recursive=True):
            for name, gb in pattern.findall(open(path).read()):
                gigabytes[name] = float(gb)
    rows = []
    for name, calls, ms in table:
        row = {"name": name[:160], "calls_per_step": calls, "ms_per_step": round(ms, 4)}
        if name in gigabytes:  # inductor reckons bytes per call
            row["gb_per_call"] = round(gigabytes[name], 4)
            row["gb_per_s"] = round(gigabytes[name] * calls / (ms / 1000), 1)
        rows.append(row)
    by_shape = []
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key in ("aten::convolution", "aten::convolution_backward", "aten::mm", "aten::addmm"):
            device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
            by_shape.append({"op": event.key, "shapes": str(event.input_shapes)[:200], "calls_per_step": event.count / steps,
                             "ms_per_step": round(device_us / 1000 / steps, 4)})
    by_shape.sort(key=lambda r: -r["ms_per_step"])
    return {"compile_seconds": compile_seconds, "gpu_ms_per_step": round(sum(r[2] for r in table), 3),
            "kernels": rows, "ops_by_shape": by_shape}


def conv_shapes() -> list[dict]:
    """Each distinct convolution of gpuaccel's ResNet-50 at 224 px, with how often it occurs."""
    import gpuaccel

    model = gpuaccel.create_model("resnet50", num_classes=CLASSES, image_size=224).cuda()
    seen: dict[tuple, dict] = {}

    def hook(module, inputs, _output):
        shape = tuple(inputs[0].shape)
        key = (shape, module.out_channels, module.kernel_size[0], module.stride[0], module.padding[0])
        seen.setdefault(key, {"input": list(shape), "out_channels": module.out_channels,
                              "kernel": module.kernel_size[0], "stride": module.stride[0],
                              "padding": module.padding[0], "count": 0})["count"] += 1
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            module.register_forward_hook(hook)
    with torch.no_grad():
        model(torch.zeros(2, 3, 224, 224, device="cuda"))
    rows = list(seen.values())
    for row in rows:
        row["input"][0] = BATCH
    return rows


def part_convs(benchmark_limit: int) -> dict:
    """Forward, input-gradient and weight-gradient time of each distinct convolution."""
    from gpuaccel.bench.timing import cuda_times_ms

    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.benchmark_limit = benchmark_limit
    rows = []
    for conv in conv_shapes():
        n, c, h, w = conv["input"]
        k, s, p = conv["kernel"], conv["stride"], conv["padding"]
        x = torch.randn(n, c, h, w, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        weight = torch.randn(conv["out_channels"], c, k, k, device="cuda", dtype=torch.bfloat16).to(
            memory_format=torch.channels_last) * 0.05
        out = F.conv2d(x, weight, None, s, p)
        grad = torch.randn_like(out)
        flop = 2 * out.numel() * c * k * k
        passes = {
            "forward": lambda: F.conv2d(x, weight, None, s, p),
            "input_grad": lambda: torch.ops.aten.convolution_backward(
                grad, x, weight, None, [s, s], [p, p], [1, 1], False, [0, 0], 1, [True, False, False]),
            "weight_grad": lambda: torch.ops.aten.convolution_backward(
                grad, x, weight, None, [s, s], [p, p], [1, 1], False, [0, 0], 1, [False, True, False]),
        }
        if c == 3:  # the stem: its input needs no gradient
            del passes["input_grad"]
        for name, fn in passes.items():
            ms = statistics.median(cuda_times_ms(fn, repeats=20, warmup=3))
            rows.append({**conv, "pass": name, "ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1),
                         "ms_in_model": round(ms * conv["count"], 4)})
    total = sum(r["ms_in_model"] for r in rows)
    return {"benchmark_limit": benchmark_limit, "total_ms": round(total, 3), "rows": rows}


def part_layers() -> dict:
    """The stem convolution (forward and weight gradient) and the max pooling after it (forward
    and backward), each way, compiled alone at the shapes of ResNet-50 at 224 px."""
    from gpuaccel.bench.timing import cuda_times_ms
    from gpuaccel.models import max_pool_kernel
    from gpuaccel.models.layers import space_to_depth_conv2d

    torch.backends.cudnn.benchmark = True
    rows = []

    def time_it(name, fn, inputs, flop=None):
        grad = torch.randn_like(fn(*inputs))

        def run():
            fn(*inputs).backward(grad)
        ms = statistics.median(cuda_times_ms(run, repeats=20, warmup=3))
        rows.append({"name": name, "ms_forward_and_backward": round(ms, 4),
                     **({"tflops": round(flop / ms / 1e9, 1)} if flop else {})})
        print(rows[-1], flush=True)

    x = torch.randn(BATCH, 3, 224, 224, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    weight = (torch.randn(64, 3, 7, 7, device="cuda") * 0.05).requires_grad_()
    flop = 2 * 2 * BATCH * 112 * 112 * 64 * 3 * 49  # forward and weight gradient

    def direct(x, w, channels=3):
        if channels > 3:
            x, w = F.pad(x, (0, 0, 0, 0, 0, channels - 3)), F.pad(w, (0, 0, 0, 0, 0, channels - 3))
        return F.conv2d(x.contiguous(memory_format=torch.channels_last), w.to(x.dtype), None, 2, 3)
    reference = direct(x, weight).float()
    for name, fn in [("stem: direct, 3 channels", direct),
                     ("stem: direct, padded to 4 channels", lambda x, w: direct(x, w, 4)),
                     ("stem: direct, padded to 8 channels", lambda x, w: direct(x, w, 8)),
                     ("stem: space-to-depth, 12 channels",
                      lambda x, w: space_to_depth_conv2d(x, w.to(x.dtype), None, 2, (3, 3), 1)),
                     ("stem: space-to-depth, padded to 16 channels",
                      lambda x, w: space_to_depth_conv2d(x, w.to(x.dtype), None, 2, (3, 3), 8))]:
        compiled = torch.compile(fn)
        error = (compiled(x, weight).float() - reference).abs().max().item()
        time_it(name, compiled, (x, weight), flop)
        rows[-1]["max_abs_difference_from_direct"] = error

    pooled_input = torch.relu(torch.randn(BATCH, 64, 112, 112, device="cuda", dtype=torch.bfloat16)).to(
        memory_format=torch.channels_last).requires_grad_()
    time_it("max pool: inductor", torch.compile(lambda t: F.max_pool2d(t, 3, 2, 1)), (pooled_input,))
    time_it("max pool: ATen", lambda t: F.max_pool2d(t, 3, 2, 1), (pooled_input,))
    chosen = (max_pool_kernel._BLOCK_PIXELS, max_pool_kernel._NUM_WARPS)
    for block, warps in [(32, 4), (128, 4), (128, 8), (256, 8), (512, 8), chosen]:
        max_pool_kernel._BLOCK_PIXELS, max_pool_kernel._NUM_WARPS = block, warps
        time_it(f"max pool: gpuaccel's Triton kernels, {block} pixels x 64 channels, {warps} warps per program",
                lambda t: max_pool_kernel.max_pool2d(t, 3, 2, 1)[0], (pooled_input,))
    ref_out = F.max_pool2d(pooled_input, 3, 2, 1)
    grad = torch.randn_like(ref_out)
    ref_grad, = torch.autograd.grad(ref_out, pooled_input, grad)
    out = max_pool_kernel.max_pool2d(pooled_input, 3, 2, 1)[0]
    got_grad, = torch.autograd.grad(out, pooled_input, grad)
    rows[-1]["same_as_aten"] = bool(torch.equal(out, ref_out)) and bool(torch.equal(got_grad, ref_grad))
    return {"rows": rows}


def part_variant(name: str) -> dict:
    import imagenet_throughput
    import torch._inductor.config as inductor_config

    global BATCH
    settings = VARIANTS[name]
    BATCH = imagenet_throughput.BATCH = settings.get("batch", BATCH)  # (this child process only)
    defaults = {}  # this torch's own value of each setting changed
    for key, value in settings.get("inductor", {}).items():
        *path, attribute = key.split(".")  # "triton.x" is inductor_config.triton.x
        owner = inductor_config
        for part in path:
            owner = getattr(owner, part)
        defaults[key] = getattr(owner, attribute)
        setattr(owner, attribute, value)
    step = build_step(settings.get("mode", "default"), plain_stem=settings.get("plain_stem", False),
                      plain_max_pool=settings.get("plain_max_pool", False),
                      linear_1x1=settings.get("linear_1x1", False),
                      fused_bn=settings.get("fused_bn", "off"),
                      tune_kernels=settings.get("tune_kernels", False))
    if "cudnn_benchmark_limit" in settings:
        torch.backends.cudnn.benchmark_limit = settings["cudnn_benchmark_limit"]
    compile_seconds = warm(step)
    row = {"variant": name, "batch": BATCH, **settings, "inductor_defaults": defaults, **timed(step),
           "compile_seconds": compile_seconds,
           "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    return row


def child(args) -> dict:
    import imagenet_throughput

    global BATCH
    BATCH = imagenet_throughput.BATCH = args.batch  # (this child process only)
    part, _, arg = args.child.partition(":")
    if part == "kernels":  # kernels:plain, kernels:fused-bn-gram (that batch-norm mode), or kernels
        return part_kernels(plain=arg == "plain", fused_bn=arg.removeprefix("fused-bn-") if arg.startswith("fused-bn-")
                            else "off")
    if part == "bandwidth":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(args.work, "inductor-bandwidth")
        return part_kernels(plain=False, bandwidth=True)
    if part == "layers":
        return part_layers()
    if part == "convs":
        return part_convs(int(arg))
    return part_variant(arg)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["layers", "variants", "kernels", "bandwidth", "convs"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--work", default="/tmp/resnet50_kernels")
    ap.add_argument("--out", required=True)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return
    os.makedirs(args.work, exist_ok=True)
    jobs = []
    for part in args.parts:
        if part in ("kernels", "layers", "bandwidth"):
            jobs.append(part)
        elif part in ("kernels-plain", "kernels-fused-bn-gram"):
            jobs.append("kernels:" + part.removeprefix("kernels-"))
        elif part == "convs":
            jobs += ["convs:10", "convs:0"]
        elif part == "variants":
            jobs += [f"variant:{v}" for v in args.variants]
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
               "cudnn": torch.backends.cudnn.version(), "batch": args.batch, "parts": {}}
    for job in jobs:
        start, done = time.perf_counter(), None
        command = [sys.executable, __file__, "--child", job, "--work", args.work, "--out", args.out,
                   "--batch", str(args.batch)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
            lines = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            row = json.loads(lines[-1]) if done.returncode == 0 and lines else \
                {"error": (done.stderr or done.stdout).strip().splitlines()[-5:]}
        except subprocess.TimeoutExpired:
            row = {"error": f"did not finish in {args.timeout:.0f} s"}
        row["seconds"] = round(time.perf_counter() - start, 1)
        if done is not None:
            with open(os.path.join(args.work, job.replace(":", "_") + ".log"), "w") as f:
                f.write(done.stdout[-200000:] + "\n--- stderr ---\n" + done.stderr[-50000:])
        results["parts"][job] = row
        brief = {k: v for k, v in row.items() if k not in ("kernels", "ops_by_shape", "calls", "rows")}
        print(job, json.dumps(brief), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
