"""Each widening 1x1 convolution of ResNet-50 at 224 px (the expansions: stride 1, at least
twice the input channels) with its batch norm's statistics, two ways, forward pass only,
each compiled as the Trainer compiles the model:

  output  the convolution (cuDNN), then the statistics from its output (var_mean, as inductor
          computes a batch norm's)
  gram    the convolution, then the statistics from its input's Gram matrix
          (models/layers.py, gram_statistics)

GPU ms per call (CUDA events, median of 20), times each layer's count in the model, and how
far the two ways' statistics are apart.

    python benchmarks/resnet50/conv1x1_stats.py --batch 256 --out conv1x1_stats.json
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
    from gpuaccel.models.layers import gram_statistics

    resnet50_kernels.BATCH = args.batch
    torch.backends.cudnn.benchmark = True

    @torch.compile
    def from_output(x, weight):
        y = F.conv2d(x, weight)
        variance, mean = torch.var_mean(y.float(), dim=(0, 2, 3), correction=0)
        return y, mean, variance

    @torch.compile
    def from_gram(x, weight):
        y = F.conv2d(x, weight)
        total, squares = gram_statistics(x, weight)
        count = y.numel() // y.shape[1]
        mean = total / count
        return y, mean, squares / count - mean * mean

    def ms(fn):
        return statistics.median(cuda_times_ms(fn, repeats=20, warmup=3))

    rows = []
    for conv in resnet50_kernels.conv_shapes():
        n, c, h, w = conv["input"]
        k = conv["out_channels"]
        if conv["kernel"] != 1 or conv["stride"] != 1 or k < 2 * c:
            continue
        # the input of an expansion is a ReLU's output
        x = torch.relu(torch.randn(n, c, h, w, device="cuda")).to(torch.bfloat16).contiguous(
            memory_format=torch.channels_last)
        weight = (torch.randn(k, c, 1, 1, device="cuda") * (2 / c) ** 0.5).to(torch.bfloat16)
        _, mean, variance = from_output(x, weight)
        _, gram_mean, gram_variance = from_gram(x, weight)
        row = {**conv, "ms_conv": ms(lambda: F.conv2d(x, weight)), "ms_output": ms(lambda: from_output(x, weight)),
               "ms_gram": ms(lambda: from_gram(x, weight)),
               "max_relative_mean_difference": ((gram_mean - mean).abs() / variance.sqrt()).max().item(),
               "max_relative_variance_difference": ((gram_variance - variance).abs() / variance).max().item()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    totals = {key: round(sum(r[key] * r["count"] for r in rows), 3) for key in ("ms_conv", "ms_output", "ms_gram")}
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "batch": args.batch,
              "per_step_forward": totals, "rows": rows}
    print(json.dumps(totals))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
