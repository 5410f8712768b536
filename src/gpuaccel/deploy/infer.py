"""Predictions with class names for images, files or a data set, with latency statistics."""

from __future__ import annotations

import csv
import io
import os
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..data import load_dataset, parse_spec
from ..data.images import ImageSource, decode_images, is_image_name
from ..errors import GpuaccelError
from .runners import Runner


def gather_inputs(inputs: list[str]) -> tuple[list[str], np.ndarray, np.ndarray | None]:
    """(names, uint8 images NCHW, labels or None). Image files and folders of them are read
    as they are; anything else is a data set spec, whose held-out split is used."""
    paths = [Path(p).expanduser() for p in inputs]
    loose = all(p.is_file() and is_image_name(p.name) for p in paths) or (
        len(paths) == 1 and paths[0].is_dir() and parse_spec(str(paths[0]))[0] == "imagefolder")
    if not loose:
        if len(inputs) != 1:
            raise GpuaccelError("give image files, one folder of images, or one data set")
        ds = load_dataset(inputs[0])
        return [f"{ds.name}:test[{i}]" for i in range(len(ds.test_labels))], ds.test_images, ds.test_labels
    files = []
    for p in paths:
        if p.is_dir():
            files += sorted(str(Path(root) / f) for root, _, names in os.walk(p) for f in names
                            if is_image_name(f) and not f.startswith("."))
        else:
            files.append(str(p))
    if not files:
        raise GpuaccelError(f"no image files in {', '.join(inputs)}")
    images, kept, bad = decode_images([ImageSource(f, f) for f in files], skip_bad=True)
    for name in bad:
        warnings.warn(f"skipped {name}: not a readable image", stacklevel=2)
    return [files[i] for i in kept], images, None


def fit_to_model(images: np.ndarray, channels: int, size: int) -> np.ndarray:
    """Converts channel count (with a note) and size (with a warning) to what the model takes."""
    have = images.shape[1]
    if have != channels:
        warnings.warn(f"images have {have} channel(s), the model takes {channels}: converted", stacklevel=2)
        if channels == 1:
            weights = np.array([0.299, 0.587, 0.114], dtype=np.float32).reshape(1, 3, 1, 1)
            images = (images.astype(np.float32) * weights).sum(1, keepdims=True).round().astype(np.uint8)
        else:
            images = np.repeat(images[:, :1], channels, axis=1)
    if images.shape[2:] != (size, size):
        warnings.warn(f"images are {images.shape[3]}x{images.shape[2]}, the model takes {size}x{size}: resized",
                      stacklevel=2)
        t = torch.from_numpy(images).float()
        images = F.interpolate(t, size=(size, size), mode="bilinear", antialias=True,
                               align_corners=False).round().clamp(0, 255).to(torch.uint8).numpy()
    return images


def predict(runner: Runner, images: np.ndarray, batch_size: int = 256) -> tuple[np.ndarray, dict]:
    """What the run's task reports for every image (a classifier's class probabilities), and
    latency statistics per batch (seconds)."""
    probs, latencies = [], []
    for start in range(0, len(images), batch_size):
        x = images[start:start + batch_size].astype(np.float32) / 255.0
        begin = time.perf_counter()
        logits = runner(x)  # returns host memory, so the GPU has finished
        latencies.append(time.perf_counter() - begin)
        probs.append(runner.task.predict(torch.from_numpy(logits)).numpy())
    warm = latencies[1:] or latencies  # the first batch pays for start-up
    stats = {"batches": len(latencies), "batch_size": batch_size, "latency_median_ms": 1000 * statistics.median(warm),
             "latency_p90_ms": 1000 * float(np.percentile(warm, 90)),
             "images_per_second": len(images) / sum(latencies) if sum(latencies) > 0 else 0.0}
    return np.concatenate(probs), stats


def top1_accuracy(probs: np.ndarray, labels: np.ndarray) -> float:
    return float((probs.argmax(1) == labels).mean())


def predictions_csv(names, probs: np.ndarray, classes: list[str], top_k: int) -> str:
    top_k = max(1, min(top_k, len(classes)))
    order = np.argsort(-probs, axis=1)[:, :top_k]
    out = io.StringIO()
    writer = csv.writer(out)
    header = ["input"]
    for k in range(1, top_k + 1):
        header += [f"class_{k}", f"prob_{k}"]
    writer.writerow(header)
    for name, row, ranked in zip(names, probs, order):
        writer.writerow([name] + [v for i in ranked for v in (classes[i], f"{row[i]:.6f}")])
    return out.getvalue()
