"""ImageNet-style training speed: the JPEG input pipeline, ResNet-50 steps on in-memory
batches, and training end to end from JPEG files, each against a plain PyTorch baseline
written here (torchvision's ImageFolder + DataLoader with PIL decoding and torchvision
transforms, torchvision's ResNet-50, bf16 autocast + channels_last + torch.compile).

    python benchmarks/resnet50/imagenet_throughput.py --work /tmp/imagenet --phases generate pipeline memory e2e \\
        --out results.json

Phases (each adds its entries to --out, so they can run in separate commands):
  generate  a synthetic ImageFolder of realistic JPEGs (smooth colour fields with texture,
            sides drawn around 500x375, Pillow quality 90), plus the same images as .tar shards
  pipeline  (a) decoded, cropped, flipped, normalised 224 px batches per second on the GPU,
            nothing else running: gpuaccel's stream loader (folder and shards) vs the baseline
  memory    (b) ResNet-50 training steps per second on one fixed in-memory batch: the baseline
            loop vs gpuaccel's Trainer step (fused SGD, cuDNN autotuning, compile modes)
  e2e       (c) ResNet-50 trained from the JPEG folder: `gpuaccel train --loader stream`
            vs the baseline loop fed by its DataLoader

All GPU times are CUDA-event or synchronised host times after warm-up; throughputs are
medians over timed windows, with the range.
"""

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

BATCH = 256
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


# --- generate ---------------------------------------------------------------------------------------------

def _write_images(job):
    """Writes ``count`` JPEGs of class folder ``folder``, seeded by ``seed``."""
    from PIL import Image, ImageFilter

    folder, count, seed = job
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    sizes = []
    for i in range(count):
        w, h = int(rng.normal(500, 40)), int(rng.normal(375, 40))
        if rng.random() < 0.2:
            w, h = h, w
        w, h = max(w, 160), max(h, 160)
        # a smooth colour field, detail at several scales, and sensor-like noise: compresses like a photo
        field = rng.integers(0, 256, (h // 24 + 2, w // 24 + 2, 3), dtype=np.uint8)
        img = Image.fromarray(field).resize((w, h), Image.BICUBIC)
        detail = rng.integers(0, 256, (h // 4 + 1, w // 4 + 1, 3), dtype=np.uint8)
        img = Image.blend(img, Image.fromarray(detail).resize((w, h), Image.BILINEAR), 0.25)
        array = np.asarray(img.filter(ImageFilter.SMOOTH), dtype=np.float32)
        array += rng.normal(0, 9, array.shape)
        buf = io.BytesIO()
        Image.fromarray(array.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
        with open(os.path.join(folder, f"{i:06d}.jpg"), "wb") as f:
            f.write(buf.getvalue())
        sizes.append(len(buf.getvalue()))
    return sizes


def _write_shard(job):
    path, files = job
    with tarfile.open(path, "w") as tar:
        for key, (file, label) in enumerate(files):
            tar.add(file, arcname=f"{Path(path).stem}_{key:06d}.jpg")
            data = str(label).encode()
            info = tarfile.TarInfo(f"{Path(path).stem}_{key:06d}.cls")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def generate(work: Path, images: int, val_images: int, classes: int) -> dict:
    folder = work / "folder"
    start = time.perf_counter()
    jobs = []
    for split, total in (("train", images), ("val", val_images)):
        for c in range(classes):
            jobs.append((str(folder / split / f"c{c:03d}"), total // classes, len(jobs)))
    with ProcessPoolExecutor() as pool:
        sizes = [s for part in pool.map(_write_images, jobs) for s in part]
    shards = work / "shards"
    shard_jobs = []
    for split, per_shard in (("train", 1000), ("val", 1000)):
        files = sorted((p, int(p.parent.name[1:])) for p in (folder / split).glob("*/*.jpg"))
        order = np.random.default_rng(0).permutation(len(files))
        files = [files[i] for i in order]
        (shards / split).mkdir(parents=True, exist_ok=True)
        for s in range(0, len(files), per_shard):
            shard_jobs.append((str(shards / split / f"{split}-{s // per_shard:05d}.tar"), files[s:s + per_shard]))
    with ProcessPoolExecutor() as pool:
        list(pool.map(_write_shard, shard_jobs))
    return {"images": images, "val_images": val_images, "classes": classes,
            "mean_jpeg_kb": round(float(np.mean(sizes)) / 1024, 1), "seconds": round(time.perf_counter() - start, 1)}


# --- the plain PyTorch baseline -------------------------------------------------------------------------------

def baseline_loader(folder: Path, workers: int, train: bool = True):
    from torchvision import datasets, transforms

    t = [transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip()] if train else \
        [transforms.Resize(256), transforms.CenterCrop(224)]
    data = datasets.ImageFolder(str(folder / ("train" if train else "val")),
                                transforms.Compose(t + [transforms.ToTensor(), transforms.Normalize(MEAN, STD)]))
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=train, num_workers=workers, pin_memory=True,
                                       drop_last=train, persistent_workers=True, prefetch_factor=4)


def baseline_model(classes: int):
    import torchvision

    model = torchvision.models.resnet50(num_classes=classes).cuda().to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5)
    compiled = torch.compile(model)

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


# --- timing helpers -------------------------------------------------------------------------------------------

def windows_per_second(batches, images_per_batch: int, warmup: int, windows: int, per_window: int) -> dict:
    """Images per second over ``windows`` windows of ``per_window`` batches from the iterator,
    synchronising at each window edge."""
    for _ in range(warmup):
        next(batches)
    torch.cuda.synchronize()
    rates = []
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(per_window):
            x, _y = next(batches)
        torch.cuda.synchronize()
        rates.append(per_window * images_per_batch / (time.perf_counter() - start))
    return summary(rates)


def summary(rates: list[float]) -> dict:
    return {"images_per_second": round(statistics.median(rates), 1), "min": round(min(rates), 1),
            "max": round(max(rates), 1), "windows": len(rates)}


def forever(make):
    while True:
        yield from make()


# --- phases ---------------------------------------------------------------------------------------------------

def pipeline(work: Path, workers: int, cpu_decode: list, baseline: bool = True) -> dict:
    from gpuaccel.data import open_dataset
    from gpuaccel.runtime.loaders import stream_loader

    device = torch.device("cuda")
    results = {}
    for layout in ("folder", "shards"):
        for share in cpu_decode:
            ds = open_dataset(str(work / layout), stream=True, image_size=224)
            loader = stream_loader(ds, train=True, batch_size=BATCH, device=device, mean=MEAN, std=STD,
                                   dtype=torch.bfloat16, channels_last=True, cpu_decode=share)
            epoch = iter(range(1000))
            batches = forever(lambda: loader.batches(next(epoch)))
            per_window = len(loader) // 2
            key = f"gpuaccel_{layout}" + ("" if share is None else f"_cpu_decode_{share}")
            results[key] = {**windows_per_second(batches, BATCH, 5, 4, per_window), "decoder": loader.transform.decoder,
                            "reader_processes": loader.passes.workers}
            print(key, results[key], flush=True)
            del batches, loader
    if not baseline:
        return results

    loader = baseline_loader(work / "folder", workers)

    def moved():
        for x, y in loader:
            yield x.cuda(non_blocking=True).to(memory_format=torch.channels_last), y.cuda(non_blocking=True)
    results["baseline_dataloader"] = {**windows_per_second(forever(moved), BATCH, 10, 4, len(loader) // 2),
                                      "workers": workers}
    print("baseline", results["baseline_dataloader"], flush=True)
    return results


def gpuaccel_step(mode: str, classes: int, x: torch.Tensor, y: torch.Tensor, tune_kernels: bool = False):
    """gpuaccel's Trainer (ResNet-50, bf16, compile mode ``mode``, or 'eager'; ``tune_kernels`` as
    --tune-kernels) on the in-memory batch (x, y): a function of no arguments that runs one
    training step. With mode reduce-overhead the step is the Trainer's step graph, warmed and
    captured as its warm-up does."""
    from gpuaccel.data.dataset import ImageDataset
    from gpuaccel.train import TrainConfig, Trainer

    rng = np.random.default_rng(0)  # the Trainer needs a data set; the steps read only (x, y)
    fake = ImageDataset("synthetic", rng.integers(0, 256, (BATCH, 3, 224, 224), dtype=np.uint8),
                        np.arange(BATCH) % classes, rng.integers(0, 256, (16, 3, 224, 224), dtype=np.uint8),
                        np.arange(16) % classes, [str(c) for c in range(classes)])
    config = TrainConfig(data="synthetic", model="resnet50", precision="bf16", compile=mode != "eager",
                         compile_mode=mode if mode != "eager" else "default", batch_size=BATCH, lr=0.1,
                         weight_decay=5e-5, monitor=False, tune_kernels=tune_kernels)
    trainer = Trainer(config, dataset=fake, quiet=True)
    x = x.to(trainer.precision.input_dtype)
    trainer.warm_up(evaluate=False, batch=(x, y))  # (with reduce-overhead: records the step graph)

    def step():
        trainer.train_step(x, y)
    return step


def memory(classes: int, modes: list[str]) -> dict:
    from gpuaccel.bench.timing import cuda_times_ms

    x = torch.randn(BATCH, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (BATCH,), device="cuda")
    steps = 10
    results = {}

    def measure(step):
        times = cuda_times_ms(lambda: [step() for _ in range(steps)], repeats=6, warmup=2)
        return summary([steps * BATCH / (t / 1000) for t in times])

    start = time.perf_counter()
    base = baseline_model(classes)
    for _ in range(3):
        base(x, y)
    torch.cuda.synchronize()
    results["baseline_compiled"] = {**measure(lambda: base(x, y)), "compile_seconds": round(time.perf_counter() - start, 1)}
    print("baseline", results["baseline_compiled"], flush=True)
    del base
    torch.cuda.empty_cache()

    for mode in modes:
        start = time.perf_counter()
        step = gpuaccel_step(mode, classes, x, y)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        results[f"gpuaccel_{mode}"] = {**measure(step), "compile_seconds": round(time.perf_counter() - start, 1)}
        print(mode, results[f"gpuaccel_{mode}"], flush=True)
        del step
        torch.cuda.empty_cache()
    return results


def e2e(work: Path, workers: int, classes: int, epochs: int, modes: list[str], cpu_decode: list,
        baseline: bool = True) -> dict:
    results = {}
    for mode, share in [(m, s) for m in modes for s in cpu_decode]:
        key = f"gpuaccel_{mode}" + ("" if share is None else f"_cpu_decode_{share}")
        run_dir = work / f"run-{key}"
        cmd = [sys.executable, "-m", "gpuaccel", "train", "--data", str(work / "folder"), "--loader", "stream",
               "--model", "resnet50", "--image-size", "224", "--precision", "bf16", "--compile",
               "--compile-mode", mode, "--batch-size", str(BATCH), "--eval-batch-size", str(BATCH),
               "--epochs", str(epochs), "--lr", "0.1", "--run-dir", str(run_dir), "--quiet"] + \
            ([] if share is None else ["--cpu-decode", str(share)])
        subprocess.run(["rm", "-rf", str(run_dir)])
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            results[key] = {"error": (done.stdout + done.stderr)[-2000:], "command": " ".join(cmd)}
        else:
            s = json.loads((run_dir / "summary.json").read_text())
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            results[key] = {
                "images_per_second": s["samples_per_second"], "train_seconds": s["train_seconds"],
                "warmup_seconds": s["warmup_seconds"], "epochs": s["epochs"],
                "per_epoch_images_per_second": [r["samples_per_second"] for r in records],
                "data_wait": [r.get("data_wait") for r in records], "gpu_util": [r.get("gpu_util") for r in records],
                "command": " ".join(cmd)}
        print("gpuaccel e2e", key, results[key], flush=True)
    if not baseline:
        return results

    # compiled before its loader starts, so no batches pile up in the workers' queues meanwhile
    step = baseline_model(classes)
    x = torch.randn(BATCH, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    for _ in range(3):
        step(x, torch.randint(0, classes, (BATCH,), device="cuda"))
    loader = baseline_loader(work / "folder", workers)

    def trained():
        for x, y in loader:
            x = x.cuda(non_blocking=True).to(memory_format=torch.channels_last)
            y = y.cuda(non_blocking=True)
            step(x, y)
            yield x, y
    steps_per_epoch = len(loader)
    results["baseline_dataloader"] = {**windows_per_second(forever(trained), BATCH, 10, 2 * epochs,
                                                           steps_per_epoch // 2), "workers": workers}
    print("baseline e2e", results["baseline_dataloader"], flush=True)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/imagenet")
    ap.add_argument("--phases", nargs="+", default=["generate", "pipeline", "memory", "e2e"])
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--val-images", type=int, default=2000)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--modes", nargs="+", default=["default", "reduce-overhead"],
                    help="gpuaccel compile modes to time in the memory phase ('eager' for none)")
    ap.add_argument("--e2e-modes", nargs="+", default=["default", "reduce-overhead"])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--cpu-decode", nargs="+", type=float, default=[None],
                    help="shares of each batch the reader processes decode (default: the loader's)")
    ap.add_argument("--skip-baselines", action="store_true", help="time gpuaccel only in the pipeline and e2e phases")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault("meta", {}).update({
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
        "cpu_cores": os.cpu_count(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "batch_size": BATCH})
    for phase in args.phases:
        start = time.perf_counter()
        if phase == "generate":
            results["generate"] = generate(work, args.images, args.val_images, args.classes)
        elif phase == "pipeline":
            results["pipeline"] = pipeline(work, args.workers, args.cpu_decode, baseline=not args.skip_baselines)
        elif phase == "memory":
            results["memory"] = memory(1000, args.modes)
        elif phase == "e2e":
            results["e2e"] = e2e(work, args.workers, args.classes, args.epochs, args.e2e_modes, args.cpu_decode,
                                 baseline=not args.skip_baselines)
        results["meta"].setdefault("commands", {})[phase] = " ".join(sys.argv)
        print(phase, "took", round(time.perf_counter() - start, 1), "s", flush=True)
        out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
