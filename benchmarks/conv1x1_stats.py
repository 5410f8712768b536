"""Each 1x1 convolution of ResNet-50 at 224 px with its batch norm's statistics, two ways, forward
pass only (the backward pass is the same for both):

  cudnn+stats  PyTorch's convolution (cuDNN), then the statistics as inductor computes them for
               a batch norm (a compiled var_mean over the output): what the compiled step runs
  triton       gpuaccel's Triton kernel, the statistics in the matrix product's epilogue
               (models/conv1x1_stats_kernel.py): on the tensor memory accelerator where the
               stride is 1 and the GPU has one
  triton_pointers  the same kernel's form that loads through pointers

GPU ms per call (CUDA events, median of 20), times each layer's count in the model, and how
far the kernel's output and sums are from PyTorch's.

    python benchmarks/conv1x1_stats.py --batch 256 --out conv1x1_stats.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import resnet50_kernels
    from gpuaccel.bench.timing import cuda_times_ms
    from gpuaccel.models import conv1x1_stats_kernel
    from gpuaccel.models.conv1x1_stats_kernel import conv1x1_stats

    resnet50_kernels.BATCH = args.batch
    torch.backends.cudnn.benchmark = True
    compiled_stats = torch.compile(lambda y: torch.var_mean(y.float(), dim=(0, 2, 3), correction=0))

    def ms(fn):
        return statistics.median(cuda_times_ms(fn, repeats=20, warmup=3))

    def pointers(fn):
        conv1x1_stats_kernel.USE_TMA = False
        try:
            return ms(fn)
        finally:
            conv1x1_stats_kernel.USE_TMA = True

    rows = []
    for conv in resnet50_kernels.conv_shapes():
        if conv["kernel"] != 1:
            continue
        n, c, h, w = conv["input"]
        s, k = conv["stride"], conv["out_channels"]
        x = torch.randn(n, c, h, w, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        weight = (torch.randn(k, c, 1, 1, device="cuda") * c ** -0.5).to(torch.bfloat16)
        y_ref = F.conv2d(x, weight, stride=s)
        y, total, squares = conv1x1_stats(x, weight, s)
        count = y.numel() // k
        wide = y.float()
        row = {**conv, "output": list(y.shape),
               "ms_conv": ms(lambda: F.conv2d(x, weight, stride=s)),
               "ms_stats": ms(lambda: compiled_stats(y_ref)),
               "ms_triton": ms(lambda: conv1x1_stats(x, weight, s)),
               "ms_triton_pointers": pointers(lambda: conv1x1_stats(x, weight, s)),
               # the same kernels without their statistics: what the epilogue costs
               "ms_triton_without_statistics": ms(lambda: conv1x1_stats(x, weight, s, statistics=False)),
               "ms_triton_pointers_without_statistics": pointers(lambda: conv1x1_stats(x, weight, s,
                                                                                      statistics=False)),
               # in units of the output's largest value: one bf16 rounding is 2**-8
               "max_output_difference": ((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item(),
               "max_mean_difference": ((total / count - wide.mean((0, 2, 3))).abs().max()).item(),
               "max_square_difference": ((squares - wide.square().sum((0, 2, 3))).abs()
                                         / wide.square().sum((0, 2, 3))).max().item()}
        flop = 2 * y.numel() * c
        row["tflops_conv"] = round(flop / row["ms_conv"] / 1e9, 1)
        row["tflops_triton"] = round(flop / row["ms_triton"] / 1e9, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    totals = {key: round(sum(r[key] * r["count"] for r in rows), 3) for key in (
        "ms_conv", "ms_stats", "ms_triton", "ms_triton_pointers", "ms_triton_without_statistics",
        "ms_triton_pointers_without_statistics")}
    totals["ms_cudnn_and_stats"] = round(totals["ms_conv"] + totals["ms_stats"], 3)
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "batch": args.batch,
              "per_step_forward": totals, "rows": rows}
    print(json.dumps(totals))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
