"""Predictions with class names for what a classifier takes (images, sentences, recordings) from
files, folders or a data set, with latency statistics."""

from __future__ import annotations

import csv
import io
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..data import load_dataset, parse_spec
from ..data.images import ImageSource, decode_images, is_image_name, why_unreadable
from ..errors import GpuaccelError
from .runners import Runner


def gather_inputs(inputs: list[str], skip_bad: bool = False) -> tuple[list[str], np.ndarray, np.ndarray | None, str | None]:
    """(names, uint8 images NCHW, labels or None, which split of a data set or None). Image files
    and a folder of image files are read as they are; anything else (a folder of class folders
    too) is a data set, whose held-out split is used, with its labels."""
    paths = [Path(p).expanduser() for p in inputs]
    loose = all(p.is_file() and is_image_name(p.name) for p in paths) or (
        len(paths) == 1 and paths[0].is_dir() and parse_spec(str(paths[0]))[0] == "imagefolder"
        and not any(p.is_dir() and not p.name.startswith(".") for p in paths[0].iterdir()))
    if not loose:
        if len(inputs) != 1:
            raise GpuaccelError("give image files, one folder of images, or one data set")
        ds = load_dataset(inputs[0])
        return ([f"{ds.name}:test[{i}]" for i in range(len(ds.test_labels))], ds.test_images, ds.test_labels,
                f"the held-out split of {ds.name} ({ds.held_out})")
    files = []
    for p in paths:
        if p.is_dir():
            files += sorted(str(Path(root) / f) for root, _, names in os.walk(p) for f in names
                            if is_image_name(f) and not f.startswith("."))
        else:
            files.append(str(p))
    if not files:
        raise GpuaccelError(f"no image files in {', '.join(inputs)}")
    try:
        images, kept, bad = decode_images([ImageSource(f, f) for f in files], skip_bad=skip_bad)
    except GpuaccelError as exc:
        raise GpuaccelError(str(exc).replace("pass --skip-bad to skip bad images", "pass --skip-bad to leave such "
                                                                                   "files out")) from None
    warn_skipped(bad)
    return [files[i] for i in kept], images, None, None


def warn_skipped(bad: list[str]) -> None:
    """One warning per image file left out (--skip-bad), with why."""
    for name in bad:
        warnings.warn(f"skipped {name}: {why_unreadable(name)}", stacklevel=3)


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


def images_for_model(images: np.ndarray) -> np.ndarray:
    """uint8 images as an image classifier takes them: float32 in [0, 1]."""
    return images.astype(np.float32) / 255.0


def ids_for_model(ids: np.ndarray) -> np.ndarray:
    """0-padded token ids as a text classifier takes them: int64, cut to the batch's longest
    sentence (at least 2 positions, as the export was traced with)."""
    return ids[:, :max(2, int((ids != 0).sum(1).max()))].astype(np.int64)


def waves_for_model(waves: np.ndarray) -> np.ndarray:
    return waves.astype(np.float32, copy=False)


@dataclass
class ModelInputs:
    """What to predict: a name per sample, the samples as stored (uint8 images, padded ids,
    waveforms), ``prepare`` turning a batch of them into what the model takes, true labels
    where the source has them."""
    names: list[str]
    samples: np.ndarray
    prepare: Callable[[np.ndarray], np.ndarray]
    unit: str  # "images", "sentences", "recordings"
    labels: np.ndarray | None = None
    notes: list[str] = field(default_factory=list)  # conversions a user should know of
    split: str | None = None  # which split of a data set the samples are (said beside its accuracy)


def read_inputs(runner: Runner, inputs: list[str], skip_bad: bool = False) -> ModelInputs:
    """``inputs`` (files, folders, a data set) read as the runner's model takes them; with
    ``skip_bad`` a file that cannot be read is left out (and said), else it is an error."""
    if runner.modality == "text":
        from ..data.sentences import pad
        from ..data.text import tokenizer_from_state
        from .text import read_sentences

        texts, labels = read_sentences(inputs, runner.classes)
        tokenizer = tokenizer_from_state(runner.inputs["tokenizer"])
        ids, _ = pad([tokenizer.encode(t) for t in texts], runner.inputs["max_tokens"])
        return ModelInputs(texts, ids, ids_for_model, "sentences", labels)
    if runner.modality == "audio":
        from ..data.audio import read_recordings

        names, waves, notes = read_recordings(inputs, runner.inputs["sample_rate"], runner.inputs["clip_samples"],
                                              skip_bad=skip_bad)
        return ModelInputs(names, waves, waves_for_model, "recordings", notes=notes)
    names, images, labels, split = gather_inputs(inputs, skip_bad)
    return ModelInputs(names, fit_to_model(images, runner.in_channels, runner.image_size), images_for_model,
                       "images", labels, split=split)


def predict(runner: Runner, samples: np.ndarray, batch_size: int = 256,
            prepare: Callable[[np.ndarray], np.ndarray] = images_for_model, raw: bool = False) -> tuple[np.ndarray, dict]:
    """What the run's task reports for every sample (a classifier's class probabilities; ``raw``:
    the model's outputs as they are), and latency statistics per batch (seconds). ``prepare``: a
    batch of ``samples`` -> the model's input."""
    probs, latencies = [], []
    for start in range(0, len(samples), batch_size):
        x = prepare(samples[start:start + batch_size])
        begin = time.perf_counter()
        logits = runner(x)  # returns host memory, so the GPU has finished
        latencies.append(time.perf_counter() - begin)
        probs.append(logits if raw else runner.task.report(torch.from_numpy(logits)).numpy())
    warm = latencies[1:] or latencies  # the first batch pays for start-up
    stats = {"batches": len(latencies), "batch_size": batch_size, "latency_median_ms": 1000 * statistics.median(warm),
             "latency_p90_ms": 1000 * float(np.percentile(warm, 90)),
             "samples_per_second": len(samples) / sum(latencies) if sum(latencies) > 0 else 0.0}
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
