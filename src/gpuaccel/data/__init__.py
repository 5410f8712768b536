"""Data: readers for real formats, a decoded-file cache, and device-resident batch loaders.

``load_dataset(spec)`` accepts ``digits`` (the embedded default), a path whose format
is detected (IDX directory, CIFAR pickle directory, ImageFolder tree, .tar[.gz] of such
a tree, .npz), or ``KIND:PATH`` to name the format explicitly. Text (a .txt file or a
folder of them, kind ``text``) is read by ``text.load_corpus``; labelled sentences (kind
``sentences``) by ``sentences.load_sentences``; recordings (a folder or .tar[.gz] of .wav files,
kind ``audio``) by ``audio.load_audio``; ratings (MovieLens files, or a CSV/TSV with user, item
and rating columns, kind ``ratings``) by ``ratings.load_ratings``; detection and segmentation
folders (kinds ``coco``, ``yolo`` and ``masks``) by ``scenes.load_scenes``.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import GpuaccelError, choice_error
from . import cache
from .dataset import ImageDataset
from .formats import READERS, ReadOptions, detect_kind
from .stream import StreamingDataset, find_shards, open_stream
from .audio import is_audio_source
from .ratings import is_ratings_source
from .scenes import SCENE_KINDS, scene_kind
from .sentences import SENTENCE_SUFFIXES
from .text import TEXT_SUFFIXES

__all__ = ["ImageDataset", "StreamingDataset", "load_dataset", "open_dataset", "parse_spec", "resolved_spec",
           "DATA_KINDS"]

TEXT_KINDS = ("text", "sentences")  # read into token ids (data/text.py, data/sentences.py), not images
AUDIO_KIND = "audio"  # read into waveforms (data/audio.py)
RATINGS_KIND = "ratings"  # read into (user, item, rating) triples (data/ratings.py)
NON_IMAGE_KINDS = (*TEXT_KINDS, AUDIO_KIND, RATINGS_KIND)
DATA_KINDS = tuple(sorted((*READERS, *NON_IMAGE_KINDS, *SCENE_KINDS)))
STREAMABLE_KINDS = ("imagefolder",)


def detect(path: Path) -> str:
    """The format at ``path``: text (a .txt file, or a folder of text files only), labelled
    sentences (a .tsv/.csv/.jsonl file, or a folder with train.tsv/.csv/.jsonl; ratings first: a
    file or folder data/ratings.py recognises), recordings (a
    folder or archive whose first file is a .wav), detection or segmentation folders (COCO
    annotations, YOLO labels or masks beside images/), else an image format (formats.detect_kind)."""
    if path.is_file() and path.suffix.lower() in TEXT_SUFFIXES:
        return "text"
    if is_ratings_source(path):
        return RATINGS_KIND
    if path.is_file() and path.suffix.lower() in SENTENCE_SUFFIXES or \
            path.is_dir() and any((path / f"train{suffix}").is_file() for suffix in SENTENCE_SUFFIXES):
        return "sentences"
    if is_audio_source(path):
        return AUDIO_KIND
    scenes = scene_kind(path)
    if scenes is not None:
        return scenes
    if path.is_dir():
        seen_text = False
        for p in path.rglob("*"):  # (stops at the first other file: an image tree is not walked)
            if p.is_file() and not p.name.startswith("."):
                if p.suffix.lower() not in TEXT_SUFFIXES:
                    break
                seen_text = True
        else:
            if seen_text:
                return "text"
    return detect_kind(path)


def parse_spec(spec: str) -> tuple[str, Path | None]:
    """'digits' | PATH | KIND:PATH  ->  (kind, path)."""
    spec = str(spec).strip()
    if spec.lower() == "digits":
        return "digits", None
    kind, sep, rest = spec.partition(":")
    if sep and kind.lower() in DATA_KINDS and len(kind) > 1:
        path = Path(rest).expanduser()
        kind = kind.lower()
    elif sep and not Path(spec).exists() and len(kind) > 1 and "/" not in kind:
        raise choice_error("data kind", kind, DATA_KINDS)
    else:
        path, kind = Path(spec).expanduser(), None
    if not path.exists():
        raise GpuaccelError(f"data path {str(path)!r} does not exist; give a data directory or file, "
                            f"or 'digits' for the built-in data set")
    return kind or detect(path), path


def resolved_spec(spec: str) -> str:
    """``spec`` with its path made absolute (``KIND:`` kept), so that a run's record of its data
    holds from any working directory and two spellings of one path compare equal."""
    text = str(spec).strip()
    kind, sep, rest = text.partition(":")
    if text.lower() == "digits" or text == "python":
        return text
    if sep and kind.lower() in DATA_KINDS and len(kind) > 1:
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
    if kind in NON_IMAGE_KINDS:
        raise GpuaccelError(f"{path} is {'text' if kind in TEXT_KINDS else kind}; image tools read image data")
    if kind in SCENE_KINDS:
        raise GpuaccelError(f"{path} is {'segmentation' if kind == 'masks' else 'detection'} data ({kind}); "
                            f"this reads images with one class each")
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
                        source=dataset.source, skipped=dataset.skipped)
