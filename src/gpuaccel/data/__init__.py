"""Data: readers for real formats, a decoded-file cache, and device-resident batch loaders.

``load_dataset(spec)`` accepts ``digits`` (the embedded default), a path whose format
is detected (IDX directory, CIFAR pickle directory, ImageFolder tree, .tar[.gz] of such
a tree, .npz), or ``KIND:PATH`` to name the format explicitly. Which kind of data a path
holds, and what reads it, is the registered data kinds' (``kinds.py``: text corpora, labelled
sentences, sentence pairs, recordings, ratings, detection and segmentation scenes, images);
``parse_spec`` asks them.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import GpuaccelError, choice_error
from . import cache
from .dataset import ImageDataset
from .formats import READERS, ReadOptions
from .images import not_a_regular_file
from .kinds import find_kind, kind_named, spec_names
from .stream import StreamingDataset, find_shards, open_stream

__all__ = ["ImageDataset", "StreamingDataset", "load_dataset", "open_dataset", "parse_spec", "resolved_spec"]

STREAMABLE_KINDS = ("imagefolder",)


def parse_spec(spec: str) -> tuple[str, Path | None]:
    """'digits' | PATH | KIND:PATH  ->  (format, path): the format named, or the one the
    registered data kinds find at the path (data/kinds.py)."""
    spec = str(spec).strip()
    if spec.lower() == "digits":
        return "digits", None
    kind, sep, rest = spec.partition(":")
    names = spec_names()
    if sep and kind.lower() in names and len(kind) > 1:
        path = Path(rest).expanduser()
        kind = kind.lower()
    elif sep and not Path(spec).exists() and len(kind) > 1 and "/" not in kind:
        raise choice_error("data kind", kind, sorted(names))
    else:
        path, kind = Path(spec).expanduser(), None
    if not path.exists():
        raise GpuaccelError(f"data path {str(path)!r} does not exist; give a data directory or file, "
                            f"or 'digits' for the built-in data set")
    odd = not_a_regular_file(path)
    if odd is not None:
        raise GpuaccelError(f"{path} is {odd}; give a data directory or file")
    return kind or find_kind(path)[1], path


def resolved_spec(spec: str) -> str:
    """``spec`` with its path made absolute (``KIND:`` kept), so that a run's record of its data
    holds from any working directory and two spellings of one path compare equal."""
    text = str(spec).strip()
    kind, sep, rest = text.partition(":")
    if text.lower() == "digits" or text == "python":
        return text
    if sep and kind.lower() in spec_names() and len(kind) > 1:
        return f"{kind.lower()}:{Path(rest).expanduser().resolve()}"
    path = Path(text).expanduser()
    return str(path.resolve()) if path.exists() else text


def load_dataset(spec: str = "digits", *, val_split: float | None = None, image_size: int | None = None,
                 skip_bad: bool = False, seed: int = 0, cache_dir: str | Path | None = "default",
                 decode_device=None) -> ImageDataset:
    """Reads a data set into memory as uint8 arrays (decoding image files once, then from cache).

    ``cache_dir=None`` turns the decoded-file cache off; the default lives under
    ``$GPUACCEL_CACHE_DIR`` or ``~/.cache/gpuaccel``. With ``decode_device`` a CUDA device
    (and torchvision installed), JPEG files are decoded on that GPU in batches (nvJPEG), whose
    pixels differ from Pillow's; gpuaccel's trainer decodes with Pillow."""
    kind, path = parse_spec(spec)
    if kind not in READERS:
        owner = kind_named(kind).name
        what = {"masks": "segmentation", "coco": "detection", "yolo": "detection"}.get(kind, owner)
        raise GpuaccelError(f"{path} is {what} data ({kind}); image tools read images with one class each")
    if cache_dir == "default":
        cache_dir = cache.default_cache_dir()
    if image_size is not None and image_size < 4:
        raise GpuaccelError(f"--image-size must be at least 4 pixels, got {image_size}")
    opts = ReadOptions(val_split=val_split, image_size=image_size, skip_bad=skip_bad, seed=seed,
                       cache_dir=Path(cache_dir) if cache_dir else None, decode_device=decode_device)
    dataset = READERS[kind](path, opts)
    if image_size is not None and dataset.train_images.shape[2:] != (image_size, image_size):
        dataset = _resized(dataset, image_size)
    return dataset


def open_dataset(spec: str = "digits", *, stream: bool = False, image_size: int | None = None,
                 val_split: float | None = None, seed: int = 0, **options) -> ImageDataset | StreamingDataset:
    """The data set of ``spec``: streamed from its files (``stream``, or a directory of .tar
    shards, which is always streamed), else decoded into memory by :func:`load_dataset`."""
    kind, path = parse_spec(spec)
    if path is not None and path.is_dir() and find_shards(path) is not None:
        return open_stream(path, image_size=image_size, val_split=val_split, seed=seed)
    if stream:
        if kind not in STREAMABLE_KINDS:
            raise GpuaccelError(f"--loader stream reads image folders and directories of .tar shards; "
                                f"{kind} data is loaded into memory (use --loader auto, gpu or cpu)")
        return open_stream(path, image_size=image_size, val_split=val_split, seed=seed)
    return load_dataset(spec, image_size=image_size, val_split=val_split, seed=seed, **options)


def _resized(dataset: ImageDataset, size: int) -> ImageDataset:
    """Array formats (IDX, CIFAR, npz) resized to --image-size, antialiased, in torch."""
    import torch
    import torch.nn.functional as F

    def resize(x):
        t = torch.from_numpy(x).float()
        out = []
        for chunk in t.split(4096):
            out.append(F.interpolate(chunk, size=(size, size), mode="bilinear", antialias=True,
                                     align_corners=False).round().clamp(0, 255).to(torch.uint8))
        return torch.cat(out).numpy()

    return ImageDataset(dataset.name, resize(dataset.train_images), dataset.train_labels,
                        resize(dataset.test_images), dataset.test_labels, dataset.classes,
                        source=dataset.source, skipped=dataset.skipped, held_out=dataset.held_out)
