"""Where the streaming JPEG pipeline's time goes: each stage alone, then the whole pipeline.

    python benchmarks/stream_stages.py /tmp/imagenet/folder --out stages.json

Run after ``imagenet_throughput.py --phases generate`` (it reads the same folder). Per
batch of 256 training images: reading the files (the pool threads), nvJPEG decoding (time
the calling thread is blocked, and until the GPU is done), the crop geometry, the
resampling and normalising (host time of the call, time until the GPU is done, and GPU
time alone, measured with the host's work queued behind a GPU sleep). Then the pipeline as
a whole: made on the calling thread, served from its background thread, and served with
a busy pure-Python thread beside it (what a training loop's kernel launches look like to
the GIL). Stage times are medians over repeated batches, after a warm-up.
"""

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from gpuaccel.data import open_dataset
from gpuaccel.data.crops import random_resized_boxes, resample_boxes

BATCH = 256
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def stats(seconds: list[float]) -> dict:
    return {"median_ms": round(statistics.median(seconds) * 1e3, 2), "min_ms": round(min(seconds) * 1e3, 2),
            "max_ms": round(max(seconds) * 1e3, 2), "batches": len(seconds)}


def timed(fn, repeats: int, warmup: int = 2) -> tuple[list[float], list[float]]:
    """(host seconds of each call, seconds until the GPU had finished it)."""
    host, synced = [], []
    for i in range(warmup + repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(i)
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        synced.append(time.perf_counter() - start)
    return host[warmup:], synced[warmup:]


def images_per_second(batches, warmup: int = 5, count: int = 40) -> float:
    for _ in range(warmup):
        next(batches)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        next(batches)
    torch.cuda.synchronize()
    return round(count * BATCH / (time.perf_counter() - start), 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda")
    dataset = open_dataset(args.folder, stream=True, image_size=224)
    loader = dataset.loader(train=True, batch_size=BATCH, device=device, mean=MEAN, std=STD, dtype=torch.bfloat16,
                            channels_last=True)
    order = loader.order.epoch_indices(0)
    steps = [order[s * BATCH:(s + 1) * BATCH].tolist() for s in range(len(loader))]
    results = {"meta": {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "command": " ".join([sys.executable] + sys.argv), "batch_size": BATCH,
                        "decoder": loader.decoder}}

    def report(key, value):
        results[key] = value
        print(key, value, flush=True)

    blobs = []

    def read(i):
        wait, _slot = loader.reader.submit(steps[i])
        got = wait()
        if len(blobs) < 8:
            # copies, because the reader reuses its buffers; pinned, as the loader's are, so that the
            # decoder's upload is timed as the pipeline pays it
            blobs.append([b.clone().pin_memory() for b in got])
    report("read", stats(timed(read, 30)[0]))

    decoded = []

    def decode(i):
        images = loader.decode(blobs[i % len(blobs)])
        if len(decoded) < len(blobs):
            decoded.append(images)
    host, synced = timed(decode, 24)
    report("decode_host", stats(host))
    report("decode_until_gpu_done", stats(synced))

    generator = torch.Generator().manual_seed(0)

    def geometry(images):
        heights = torch.tensor([x.shape[1] for x in images])
        widths = torch.tensor([x.shape[2] for x in images])
        return random_resized_boxes(heights, widths, generator), torch.rand(len(images), generator=generator) < 0.5

    report("crop_geometry_host", stats(timed(lambda i: geometry(decoded[i % len(decoded)]), 24)[0]))

    def crop(i):
        images = decoded[i % len(decoded)]
        boxes, flip = geometry(images)
        loader.normaliser.finish(loader.normaliser.scale(resample_boxes(images, boxes, 224, flip)))
    host, synced = timed(crop, 24)
    report("resample_host", stats(host))
    report("resample_until_gpu_done", stats(synced))
    gpu = []
    for i in range(26):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # the host queues all of the work before the GPU starts it
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        crop(i)
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) / 1e3)
    report("resample_gpu", stats(gpu[2:]))

    report("pipeline_on_calling_thread_img_s", images_per_second(iter(loader.prepared(1))))
    report("pipeline_served_img_s", images_per_second(iter(loader.batches(2))))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
