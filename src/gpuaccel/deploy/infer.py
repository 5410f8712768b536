"""Predictions with class names for what a classifier takes (images, sentences, recordings) from
files, folders or a data set, with latency statistics.

Inputs are read, run and written in chunks of :data:`CHUNK` samples (image files decoded a chunk
ahead, in the background, while the model runs on the one before), so memory does not grow with
their number: a folder of a million frames is processed in the memory of a few thousand."""

from __future__ import annotations

import contextlib
import csv
import io
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from ..data import load_dataset, parse_spec
from ..data.images import ImageSource, decode_images, is_image_name, why_unreadable
from ..errors import GpuaccelError
from .runners import Runner


CHUNK = 4096  # samples read, run and written at a time (the model's, and the next decoded meanwhile)


@dataclass
class Chunk:
    """Consecutive inputs: their names, the samples as stored (uint8 images, padded ids,
    waveforms), and their true labels where the source has them."""

    names: list[str]
    samples: np.ndarray
    labels: np.ndarray | None = None
    sizes: list[tuple[int, int]] | None = None  # (decoded files: each one's own (width, height), upright)


def in_chunks(names: list[str], samples: np.ndarray, labels: np.ndarray | None = None,
              size: int | None = None) -> Iterator[Chunk]:
    size = size or CHUNK
    for start in range(0, len(names), size):
        yield Chunk(names[start:start + size], samples[start:start + size],
                    None if labels is None else labels[start:start + size])


def ahead(chunks: Iterator, depth: int = 1) -> Iterator:
    """``chunks``, ``depth`` of them made in a background thread while the caller works on the one
    before (the decoders run in their own processes; the thread only waits for them). A chunk is
    asked for only once the caller has the one before: ``depth`` + 1 chunks are held at most, where
    decoders faster than the model would otherwise fill one more."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = [pool.submit(next, chunks, None) for _ in range(depth)]
        while True:
            item = pending.pop(0).result()
            if item is None:
                for future in pending:
                    future.cancel()
                return
            pending.append(pool.submit(next, chunks, None))
            yield item
            item = None  # (the caller's, not this generator's, while it waits for the next)


def image_files(inputs: list[str]) -> list[str] | None:
    """The image files that ``inputs`` name (files, or one folder of image files without class
    folders), in order; None where ``inputs`` are a data set instead (a folder of class folders, a
    format gpuaccel reads)."""
    paths = [Path(p).expanduser() for p in inputs]
    loose = all(p.is_file() and is_image_name(p.name) for p in paths) or (
        len(paths) == 1 and paths[0].is_dir() and parse_spec(str(paths[0]))[0] == "imagefolder"
        and not any(p.is_dir() and not p.name.startswith(".") for p in paths[0].iterdir()))
    if not loose:
        if len(inputs) != 1:
            raise GpuaccelError("give image files, one folder of images, or one data set")
        return None
    files = []
    for p in paths:
        if p.is_dir():
            files += images_in(p)
        else:
            files.append(str(p))
    if not files:
        raise GpuaccelError(f"no image files in {', '.join(inputs)}")
    return files


def images_in(folder) -> list[str]:
    """The image files under ``folder``, hidden ones left out, sorted by path (os.path, not
    pathlib: a folder of 50,000 frames is listed in a tenth of the time)."""
    return sorted(os.path.join(root, f) for root, _, names in os.walk(folder) for f in names
                  if is_image_name(f) and not f.startswith("."))


def decoded(files: list[str], *, skip_bad: bool = False, image_size: int | None = None,
            size: int | None = None) -> Iterator[Chunk]:
    """``files`` decoded a chunk at a time (uint8 NCHW; a file that cannot be read is an error, or
    with ``skip_bad`` left out and named)."""
    from concurrent.futures import ProcessPoolExecutor

    size = size or CHUNK
    with contextlib.ExitStack() as stack:  # (one pool of decoders for every chunk, where there are several)
        pool = stack.enter_context(ProcessPoolExecutor(os.cpu_count())) if len(files) > size and \
            (os.cpu_count() or 1) > 1 else None
        yield from _decoded(files, skip_bad, image_size, size, pool)


def _decoded(files, skip_bad, image_size, size, pool) -> Iterator[Chunk]:
    for start in range(0, len(files), size):
        part = files[start:start + size]
        try:
            images, kept, bad, sizes = decode_images([ImageSource(f, f) for f in part], image_size=image_size,
                                                     skip_bad=skip_bad, pool=pool, sizes=True, view=True)
        except GpuaccelError as exc:
            if skip_bad and "none of the" in str(exc):  # (a chunk of bad files only: each named, none kept)
                warn_skipped(part)
                continue
            raise GpuaccelError(str(exc).replace("pass --skip-bad to skip bad images", "pass --skip-bad to leave "
                                                                                       "such files out")) from None
        warn_skipped(bad)
        yield Chunk([part[i] for i in kept], images, sizes=sizes)


def gather_inputs(inputs: list[str], skip_bad: bool = False) -> tuple[Callable[[], Iterator[Chunk]], str | None]:
    """(chunks of (names, uint8 images NCHW, labels or None), which split of a data set or None).
    Image files and a folder of image files are read as they are, a chunk at a time; anything
    else (a folder of class folders too) is a data set, whose held-out split is used, with its
    labels."""
    files = image_files(inputs)
    if files is None:
        ds = load_dataset(inputs[0])
        names = [f"{ds.name}:test[{i}]" for i in range(len(ds.test_labels))]
        return (lambda: in_chunks(names, ds.test_images, ds.test_labels),
                f"the held-out split of {ds.name} ({ds.held_out})")
    return (lambda: ahead(decoded(files, skip_bad=skip_bad))), None


def warn_skipped(bad: list[str]) -> None:
    """One warning per image file left out (--skip-bad), with why."""
    for name in bad:
        warnings.warn(f"skipped {name}: {why_unreadable(name)}", stacklevel=3)


FITTED_AT_ONCE = 256  # images converted at a time: the float copies of a whole chunk were 8-16x its bytes


def fit_to_model(images: np.ndarray, channels: int, size: int) -> np.ndarray:
    """Converts channel count (with a note) and size (with a warning) to what the model takes,
    ``FITTED_AT_ONCE`` images at a time."""
    have = images.shape[1]
    if have != channels:
        warnings.warn(f"images have {have} channel(s), the model takes {channels}: converted", stacklevel=2)
        if channels == 1:
            weights = np.array([0.299, 0.587, 0.114], dtype=np.float32).reshape(1, 3, 1, 1)
            images = _in_parts(images, 1, images.shape[2:], lambda part: (
                part.astype(np.float32) * weights).sum(1, keepdims=True).round())
        else:
            images = np.repeat(images[:, :1], channels, axis=1)
    if images.shape[2:] != (size, size):
        warnings.warn(f"images are {images.shape[3]}x{images.shape[2]}, the model takes {size}x{size}: resized",
                      stacklevel=2)
        images = _in_parts(images, images.shape[1], (size, size), lambda part: F.interpolate(
            torch.from_numpy(part).float(), size=(size, size), mode="bilinear", antialias=True,
            align_corners=False).round().clamp(0, 255).numpy())
    return images


def _in_parts(images: np.ndarray, channels: int, hw: tuple[int, int], convert) -> np.ndarray:
    """uint8 (N, ``channels``, *``hw``) images: ``convert`` (to values in 0-255) of each part of
    ``FITTED_AT_ONCE`` of ``images``."""
    out = np.empty((len(images), channels, *hw), dtype=np.uint8)
    for start in range(0, len(images), FITTED_AT_ONCE):
        out[start:start + FITTED_AT_ONCE] = convert(images[start:start + FITTED_AT_ONCE])
    return out


def images_for_model(images: np.ndarray) -> np.ndarray:
    """uint8 images as an image classifier takes them: float32 in [0, 1] (in PyTorch's threads:
    numpy converts on one core, ten times slower for a batch of 1,024 128-px images on two)."""
    return torch.from_numpy(np.ascontiguousarray(images)).float().div_(255.0).numpy()


def ids_for_model(ids: np.ndarray) -> np.ndarray:
    """0-padded token ids as a text classifier takes them: int64, cut to the batch's longest
    sentence (at least 2 positions, as the export was traced with)."""
    return ids[:, :max(2, int((ids != 0).sum(1).max()))].astype(np.int64)


def waves_for_model(waves: np.ndarray) -> np.ndarray:
    return waves.astype(np.float32, copy=False)


@dataclass
class ModelInputs:
    """What to predict: ``chunks()`` of inputs (a name per sample, the samples as stored: uint8
    images, padded ids, waveforms; true labels where the source has them), read as they are
    used; ``prepare`` turning a batch of samples into what the model takes."""
    chunks: Callable[[], Iterator[Chunk]]
    prepare: Callable[[np.ndarray], np.ndarray]
    unit: str  # "images", "sentences", "recordings"
    notes: list[str] = field(default_factory=list)  # conversions a user should know of
    split: str | None = None  # which split of a data set the samples are (said beside its accuracy)


def read_inputs(runner: Runner, inputs: list[str], skip_bad: bool = False) -> ModelInputs:
    """``inputs`` (files, folders, a data set) as the runner's model takes them, chunk by chunk;
    with ``skip_bad`` a file that cannot be read is left out (and said), else it is an error."""
    if runner.modality == "text":
        from ..data.sentences import pad
        from ..data.text import tokenizer_from_state
        from .text import sentence_chunks

        chunks = sentence_chunks(inputs, runner.classes, CHUNK)  # (its inputs checked here)
        tokenizer = tokenizer_from_state(runner.inputs["tokenizer"])

        def sentences():
            for texts, labels in chunks():
                ids, _ = pad([tokenizer.encode(t) for t in texts], runner.inputs["max_tokens"])
                yield Chunk(texts, ids, labels)
        return ModelInputs(sentences, ids_for_model, "sentences")
    if runner.modality == "audio":
        from ..data.audio import decode_recordings, recording_files

        files, notes = recording_files(inputs), []

        def recordings():
            for start in range(0, len(files), CHUNK):
                names, waves = decode_recordings(files[start:start + CHUNK], runner.inputs["sample_rate"],
                                                 runner.inputs["clip_samples"], skip_bad=skip_bad, notes=notes)
                if names:
                    yield Chunk(names, waves)
        return ModelInputs(lambda: ahead(recordings()), waves_for_model, "recordings", notes=notes)
    chunks, split = gather_inputs(inputs, skip_bad)

    def fitted():
        for chunk in chunks():
            yield Chunk(chunk.names, fit_to_model(chunk.samples, runner.in_channels, runner.image_size), chunk.labels)
    return ModelInputs(fitted, images_for_model, "images", split=split)


class Latency:
    """Each batch's seconds in the model, over a whole inference; the first batch pays for
    start-up and is left out of the statistics where there are others."""

    def __init__(self):
        self.seconds: list[float] = []
        self.samples = 0

    def summary(self, batch_size: int) -> dict:
        warm = self.seconds[1:] or self.seconds or [0.0]
        total = sum(self.seconds)
        return {"batches": len(self.seconds), "batch_size": batch_size,
                "latency_median_ms": 1000 * statistics.median(warm),
                "latency_p90_ms": 1000 * float(np.percentile(warm, 90)),
                "samples_per_second": self.samples / total if total > 0 else 0.0}


def predict(runner: Runner, samples: np.ndarray, batch_size: int = 256,
            prepare: Callable[[np.ndarray], np.ndarray] = images_for_model, raw: bool = False,
            latency: Latency | None = None) -> tuple[np.ndarray, dict]:
    """What the run's task reports for every sample (a classifier's class probabilities; ``raw``:
    the model's outputs as they are), and latency statistics per batch (seconds), added to
    ``latency`` where given (an inference in chunks). ``prepare``: a batch of ``samples`` -> the
    model's input."""
    latency = latency if latency is not None else Latency()
    probs = []
    as_stored = prepare is images_for_model and runner.scales_images  # (the runner scales on its device)
    for start in range(0, len(samples), batch_size):
        x = samples[start:start + batch_size] if as_stored else prepare(samples[start:start + batch_size])
        begin = time.perf_counter()
        logits = runner(x)  # returns host memory, so the GPU has finished
        latency.seconds.append(time.perf_counter() - begin)
        latency.samples += len(x)
        probs.append(logits if raw else runner.task.report(torch.from_numpy(logits)).numpy())
    return np.concatenate(probs), latency.summary(batch_size)


def top1_accuracy(probs: np.ndarray, labels: np.ndarray) -> float:
    return float((probs.argmax(1) == labels).mean())


def predictions_csv(names, probs: np.ndarray, classes: list[str], top_k: int, header: bool = True) -> str:
    top_k = max(1, min(top_k, len(classes)))
    order = np.argsort(-probs, axis=1)[:, :top_k]
    out = io.StringIO()
    writer = csv.writer(out)
    if header:
        row = ["input"]
        for k in range(1, top_k + 1):
            row += [f"class_{k}", f"prob_{k}"]
        writer.writerow(row)
    for name, row, ranked in zip(names, probs, order):
        writer.writerow([name] + [v for i in ranked for v in (classes[i], f"{row[i]:.6f}")])
    return out.getvalue()
