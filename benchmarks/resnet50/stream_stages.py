"""Where the streaming JPEG pipeline's time goes: each stage alone, then the whole pipeline.

    python benchmarks/resnet50/stream_stages.py /tmp/imagenet/folder --out stages.json

Run after ``imagenet_throughput.py --phases generate`` (it reads the same folder). Per
batch of 256 training images: reading the files, and reading and decoding them with Pillow
(one reader process's work), nvJPEG decoding through torchvision and through the loader's
direct call (time the calling thread is blocked, and until the GPU is done), the crop geometry, the
resampling and normalising with each resampler (host time of the call, time until the GPU
is done, and GPU time alone, measured with the host's work queued behind a GPU sleep), and
how far the two resamplers' outputs are apart. Then the pipeline as a whole: made on the
calling thread, and served from its background thread. Stage times are medians over
repeated batches, after a warm-up.

With ``--under-load`` the served pipeline is measured again beside three loads, with the
wall time of its stages recorded per batch: a pure-Python thread (contention for the GIL
only), a thread replaying a CUDA graph of large matrix products (contention for the GPU
only), and the compiled ResNet-50 training step of ``imagenet_throughput.py`` consuming
the batches (both, as in end-to-end training), next to that step's rate on one batch
held in memory. Where the loader calls nvJPEG directly (its default on GPUs with JPEG
engines), the direct decode is timed too,
and training from the pipeline in windows taken in turn with the direct call and with
torchvision's. ``--cpu-decode`` sets the share the reader processes decode.
"""

import argparse
import json
import statistics
import sys
import threading
import time
from datetime import datetime, timezone

import torch

from gpuaccel.data import open_dataset, stream
from gpuaccel.data.crops import random_resized_boxes, resample_boxes
from gpuaccel.runtime.loaders import stream_loader

BATCH = 256
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def stats(seconds: list[float]) -> dict:
    if not seconds:
        return {"batches": 0}
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


def images_per_second(batches, warmup: int = 5, count: int = 40, limit_s: float = 30.0) -> float:
    """Rate over ``count`` batches after ``warmup``, or over those done within ``limit_s``."""
    for _ in range(warmup):
        next(batches)
    torch.cuda.synchronize()
    start = time.perf_counter()
    done = 0
    while done < count and time.perf_counter() - start < limit_s:
        next(batches)
        done += 1
    torch.cuda.synchronize()
    return round(done * BATCH / (time.perf_counter() - start), 1)


class StageClock:
    """Records the wall time of the loader's nvJPEG calls, of its whole decoding step (the
    upload of the reader processes' images included) and of resampling, per batch."""

    def __init__(self, loader):
        self.times = {"nvjpeg": [], "decode": [], "resample": []}
        stream._decode_on_gpu = self._timed("nvjpeg", stream._decode_on_gpu)
        made = loader.transform  # (data.stream.JpegBatches: what makes each batch on the device)
        if made.batch_decoder is not None:
            made.batch_decoder.decode = self._timed("nvjpeg", made.batch_decoder.decode)
        made._decoded = self._timed("decode", made._decoded)
        stream.resample_boxes = self._timed("resample", stream.resample_boxes)

    def _timed(self, key, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[key].append(time.perf_counter() - start)
        return wrapper

    def since(self, marks: dict) -> dict:
        return {key: stats(self.times[key][marks[key]:]) for key in self.times}

    def marks(self) -> dict:
        return {key: len(values) for key, values in self.times.items()}


def busy_python(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def gpu_load():
    """A CUDA graph of large matrix products (about 30 ms on an H200), captured now, and a
    thread body that replays it until stopped: GPU work that needs almost no GIL."""
    side = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        a @ a
    side.synchronize()
    with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
        for _ in range(20):
            a @ a

    def busy_gpu(stop: threading.Event) -> None:
        while not stop.is_set():
            graph.replay()
            side.synchronize()
    return busy_gpu


def under_load(loader) -> dict:
    """The served pipeline beside each load; then training from the pipeline."""
    from imagenet_throughput import baseline_model

    busy_gpu = gpu_load()
    clock = StageClock(loader)
    results = {}
    epochs = iter(range(10, 1000))

    def batches():
        while True:
            yield from loader.batches(next(epochs))
    served = batches()
    for load in (busy_python, busy_gpu):
        stop = threading.Event()
        worker = threading.Thread(target=load, args=(stop,), daemon=True)
        worker.start()
        time.sleep(1.0)
        marks = clock.marks()
        rate = images_per_second(served, warmup=2, count=30, limit_s=10.0)
        results[f"served_beside_{load.__name__}"] = {"img_s": rate, **clock.since(marks)}
        print(results, flush=True)
        stop.set()
        worker.join()

    step = baseline_model(100)
    x, y = next(served)
    for _ in range(3):
        step(x, y)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(30):
        step(x, y)
    torch.cuda.synchronize()
    results["training_step_in_memory_img_s"] = round(30 * BATCH / (time.perf_counter() - start), 1)

    def trained(source):
        for x, y in source:
            step(x, y)
            yield x, y
    # windows taken in turn with each decoder, so that drift of the machine affects both alike
    own = loader.transform.batch_decoder
    decoders = {"direct": own, "torchvision": None} if own is not None else {"torchvision": None}
    for _ in range(3):
        for name, decoder in decoders.items():
            loader.transform.batch_decoder = decoder
            marks = clock.marks()
            window = {"img_s": images_per_second(trained(served), warmup=4, count=40), **clock.since(marks)}
            results.setdefault(f"training_from_the_pipeline_{name}", []).append(window)
    loader.transform.batch_decoder = own
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--under-load", action="store_true")
    ap.add_argument("--cpu-decode", type=float, help="share of each batch the reader processes decode")
    args = ap.parse_args()
    device = torch.device("cuda")
    dataset = open_dataset(args.folder, stream=True, image_size=224)
    loader = stream_loader(dataset, train=True, batch_size=BATCH, device=device, mean=MEAN, std=STD,
                           dtype=torch.bfloat16, channels_last=True, cpu_decode=args.cpu_decode)
    order = loader.passes.order.epoch_indices(0)
    steps = [order[s * BATCH:(s + 1) * BATCH].tolist() for s in range(len(loader))]
    if len(steps) < 46:  # (30 batches read, then 6 more from the 40th decoded with Pillow)
        ap.error(f"{args.folder}: {len(steps)} training batches of {BATCH}; the stages need 46 (11,776 images)")
    results = {"meta": {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "command": " ".join([sys.executable] + sys.argv), "batch_size": BATCH,
                        "decoder": loader.transform.decoder}}

    def report(key, value):
        results[key] = value
        print(key, value, flush=True)

    blobs, hosts = [], []
    reader, pillow = stream._FileBatches(dataset.train, 0.0), stream._FileBatches(dataset.train, 1.0)

    def read(i):
        host = reader[steps[i]]
        if len(blobs) < 8:
            # pinned, as the loader's are, so that the decoder's upload is timed as the pipeline pays it
            starts = host.frames[:, 0].tolist()
            blobs.append([host.compressed[a:a + n].pin_memory() for a, n in zip(starts, host.lengths.tolist())])
            hosts.append((host.compressed.pin_memory(), host.frames.numpy(), host.lengths.numpy()))
    report("read_one_process", stats(timed(read, 30)[0]))
    report("read_and_decode_with_pillow_one_process", stats(timed(lambda i: pillow[steps[40 + i]], 6)[0]))

    decoded = []

    def decode(i):
        images = stream._decode_on_gpu(blobs[i % len(blobs)], device)
        if len(decoded) < len(blobs):
            decoded.append(images)
    host, synced = timed(decode, 24)
    report("decode_host", stats(host))
    report("decode_until_gpu_done", stats(synced))
    if loader.transform.batch_decoder is not None:  # the loader's own call: nvJPEG's hardware decoder without torchvision
        def direct(i):
            data, frames, lengths = hosts[i % len(hosts)]
            loader.transform.batch_decoder.decode(data, frames[:, 0], lengths, frames[:, 1], frames[:, 2])
        host, synced = timed(direct, 24)
        report("decode_direct_host", stats(host))
        report("decode_direct_until_gpu_done", stats(synced))

    generator = torch.Generator().manual_seed(0)

    def geometry(images):
        heights = torch.tensor([x.shape[1] for x in images])
        widths = torch.tensor([x.shape[2] for x in images])
        return random_resized_boxes(heights, widths, generator), torch.rand(len(images), generator=generator) < 0.5

    report("crop_geometry_host", stats(timed(lambda i: geometry(decoded[i % len(decoded)]), 24)[0]))

    for method in ("matrices", "kernel"):
        def crop(i):
            images = decoded[i % len(decoded)]
            boxes, flip = geometry(images)
            # the batch as training takes it, made as the loader makes it
            return resample_boxes(images, boxes, 224, flip, method=method, **loader.transform.normaliser.finished_form)
        host, synced = timed(crop, 24)
        report(f"resample_{method}_host", stats(host))
        report(f"resample_{method}_until_gpu_done", stats(synced))
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
        report(f"resample_{method}_gpu", stats(gpu[2:]))

    images = decoded[0]
    boxes, flip = geometry(images)
    apart = (resample_boxes(images, boxes, 224, flip, method="kernel")
             - resample_boxes(images, boxes, 224, flip, method="matrices")).abs()
    report("kernel_vs_matrices_grey_levels", {"max": round(apart.max().item(), 3),
                                              "mean": round(apart.mean().item(), 4)})

    report("pipeline_on_calling_thread_img_s", images_per_second(map(loader.transform, loader.passes.read(1, 0))))
    report("pipeline_served_img_s", images_per_second(iter(loader.batches(2))))
    if args.under_load:
        for name, value in under_load(loader).items():
            report(name, value)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
