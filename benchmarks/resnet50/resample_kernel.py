"""GPU time of the streaming loader's Triton resampler per batch, against an older version.

    python benchmarks/resnet50/resample_kernel.py /tmp/imagenet/folder --baseline old/resample_kernel.py \\
        --out resample.json

Run after ``imagenet_throughput.py --phases generate``. Batches of 256 training images are
read and decoded as the streaming loader does (nvJPEG into one buffer, an
:class:`ImageTable`), and each is resampled to 224 x 224 with random-resized-crop boxes
and flips, then normalised to bf16 channels_last (what training receives) by:

- ``baseline``: the ``--baseline`` module's ``resample_layout`` (fp32, NCHW), then the
  normaliser's two further steps (scale, then dtype and layout);
- ``unfused``: this tree's kernel (at its default tile shape) the same way;
- ``fused_B{block}_W{warps}_T{taps}``: this tree's kernel finishing the batch in its one
  pass, for each tile shape (output pixels per program, warps, column taps held at once).

GPU time is measured with CUDA events around the work, queued behind a GPU sleep so that
the host's launch cost is not in it; the variants take turns per repetition. Reported:
median, min and max over the repetitions, and the largest difference of each variant's
batch from the baseline's, in bf16 steps of the value.
"""

import argparse
import importlib.util
import itertools
import json
import statistics
import sys
from datetime import datetime, timezone

import torch

from gpuaccel.data import open_dataset, resample_kernel
from gpuaccel.data.crops import random_resized_boxes
from gpuaccel.runtime.loaders import stream_loader

BATCH = 256
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("baseline_resample_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpu_ms(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the host queues everything before the GPU starts on it
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--baseline", required=True, help="an older resample_kernel.py")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--blocks", default="64,128,256")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--taps", default="4,8")
    args = ap.parse_args()
    device = torch.device("cuda")
    dataset = open_dataset(args.folder, stream=True, image_size=224)
    loader = stream_loader(dataset, train=True, batch_size=BATCH, device=device, mean=MEAN, std=STD,
                           dtype=torch.bfloat16, channels_last=True, workers=0)
    made = loader.transform  # (data.stream.JpegBatches: what makes each batch on the device)
    normaliser = made.normaliser
    baseline = load_module(args.baseline)
    order = loader.passes.order.epoch_indices(0)
    generator = torch.Generator().manual_seed(0)
    batches = []
    for step in range(args.batches):
        host = loader.passes._reader.loader.dataset[order[step * BATCH:(step + 1) * BATCH].tolist()]
        table, failures = made._decoded(host)
        assert not failures, failures
        heights, widths = torch.from_numpy(table.sizes[:, 0]), torch.from_numpy(table.sizes[:, 1])
        boxes = random_resized_boxes(heights, widths, generator)
        flip = torch.rand(len(table), generator=generator) < 0.5
        batches.append((host, table, table.addresses(), boxes, flip))  # the host batch keeps the pixels alive
    torch.cuda.synchronize()

    default = (resample_kernel._BLOCK, resample_kernel._WARPS, resample_kernel._TAP_BLOCK)

    def finish_after(module):
        def run(batch):
            if module is resample_kernel:  # the module's own tile shape, whichever variant ran before
                resample_kernel._BLOCK, resample_kernel._WARPS, resample_kernel._TAP_BLOCK = default
            _, table, addresses, boxes, flip = batch
            raw = module.resample_layout(addresses, table.sizes, 3, device, boxes, 224, flip)
            return normaliser.finish(normaliser.scale(raw))
        return run

    def fused(block, warps, taps):
        def run(batch):
            resample_kernel._BLOCK, resample_kernel._WARPS, resample_kernel._TAP_BLOCK = block, warps, taps
            _, table, addresses, boxes, flip = batch
            return resample_kernel.resample_layout(addresses, table.sizes, 3, device, boxes, 224, flip,
                                                   **normaliser.finished_form)
        return run

    variants = {"baseline": finish_after(baseline), "unfused": finish_after(resample_kernel)}
    for block, warps, taps in itertools.product(*(map(int, a.split(",")) for a in (args.blocks, args.warps,
                                                                                      args.taps))):
        variants[f"fused_B{block}_W{warps}_T{taps}"] = fused(block, warps, taps)
    variants.setdefault("fused_B{}_W{}_T{}".format(*default), fused(*default))

    reference = [variants["baseline"](b).float() for b in batches]
    results = {"meta": {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "command": " ".join([sys.executable] + sys.argv), "batch_size": BATCH,
                        "module_default": "fused_B{}_W{}_T{}".format(*default), "decoder": made.decoder},
               "variants": {}}
    for name, run in variants.items():
        worst = 0.0
        for batch, expected in zip(batches, reference):
            got = run(batch).float()
            # in steps of bf16 at the value's magnitude (2^-8 relative)
            worst = max(worst, ((got - expected).abs() / (expected.abs() * 2**-8 + 1e-3)).max().item())
        results["variants"][name] = {"times_ms": [], "max_difference_bf16_steps": round(worst, 2)}
    for repeat in range(args.repeats + 2):
        for name, run in variants.items():
            ms = gpu_ms(lambda: run(batches[repeat % len(batches)]))
            if repeat >= 2:
                results["variants"][name]["times_ms"].append(round(ms, 4))
    for name, entry in results["variants"].items():
        times = entry["times_ms"]
        entry.update(median_ms=round(statistics.median(times), 3), min_ms=min(times), max_ms=max(times))
        print(f"{name:24s} median {entry['median_ms']:.3f} ms  [{entry['min_ms']:.3f}, {entry['max_ms']:.3f}]  "
              f"max diff {entry['max_difference_bf16_steps']} bf16 steps", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
