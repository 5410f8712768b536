"""Milliseconds per training step (forward, backward, optimizer) for a model at a batch size,
eager vs torch.compile modes, with CUDA events after warm-up; median of the timed steps.

    python benchmarks/resnet50/step_time.py --model fastnet --batch-size 1024
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

import gpuaccel
from gpuaccel.bench.timing import cuda_times_ms


def training_step(model, opt, x, y):
    """One bf16-autocast training step on the batch (x, y), as a function of no arguments."""
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def time_steps(model, opt, x, y, steps=50, warmup=10):
    times = cuda_times_ms(training_step(model, opt, x, y), repeats=steps, warmup=warmup)
    return statistics.median(times), min(times), max(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="fastnet")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--modes", default="eager,default,reduce-overhead")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device="cuda").to(
        memory_format=torch.channels_last).to(torch.bfloat16)
    y = torch.randint(0, 10, (args.batch_size,), device="cuda")
    rows = []
    for mode in args.modes.split(","):
        torch.manual_seed(0)
        model = gpuaccel.create_model(args.model, image_size=args.image_size).cuda().to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, fused=True)
        net = model if mode == "eager" else torch.compile(model, mode=mode)
        median, low, high = time_steps(net, opt, x, y)
        rows.append({"model": args.model, "batch_size": args.batch_size, "mode": mode, "ms_median": median,
                     "ms_min": low, "ms_max": high, "images_per_second": args.batch_size / median * 1000})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
