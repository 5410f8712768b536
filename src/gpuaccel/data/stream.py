"""Streaming JPEG data sets: image folders and WebDataset-style .tar shards larger than memory.

Nothing is decoded up front. An index of where each image's bytes are (a file, or an
offset and length inside a shard) is built once. Reader processes (a PyTorch DataLoader
over batches) read each batch's compressed files into shared memory and decode a share of
them with Pillow; the rest are decoded on the GPU in one nvJPEG call
(``torchvision.io.decode_jpeg(..., device="cuda")``, which uses the GPU's hardware JPEG
decoder for baseline JPEGs), and the whole batch is cropped, resized, flipped and
normalised on the device (``crops.py``). Without a GPU decoder the processes decode it
all. The processes read on into the next epoch while one ends (:class:`loader.PassReader`).
:class:`JpegPasses` is that host side and :class:`JpegBatches` the device side;
``runtime.loaders.stream_loader`` joins them in a ``PrefetchLoader`` whose background thread
makes the device batches on a side CUDA stream, so the training step only waits on a CUDA event.

Order: an image folder is served like the in-memory loaders (a per-epoch permutation,
each rank a disjoint shard, every image once per epoch). Shards are read as wholes,
as WebDataset does: each rank owns a disjoint set of shards, visits them in a
per-epoch order, and shuffles samples within a window of a few consecutive shards, so
reads stay within a few files at a time. Ranks own different numbers of images, so
every rank takes as many steps as the smallest owner can fill; the rest of a rank's
images that epoch are left out (a different rest every epoch).
"""

from __future__ import annotations

import collections
import functools
import math
import os
import tarfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..errors import GpuaccelError
from . import nvjpeg
from .crops import ImageTable, centre_boxes, random_resized_boxes, resample_boxes
from .dataset import stratified_split
from .formats import TEST_SPLIT_NAMES, common_root, _scan_tree, split_tree
from .images import ImageSource, _decode_one, is_image_name
from .loader import PassReader, next_epoch, Normaliser, ShardedOrder

DEFAULT_IMAGE_SIZE = 224
SHUFFLE_WINDOW = 4  # shards whose samples are shuffled together
# With at least this many reader processes they decode every image with Pillow by default, on a
# GPU machine too; with fewer, nvJPEG decodes them all. Pillow takes about 1 ms of a core per
# ImageNet-sized JPEG. For a compiled ResNet-50 on one data-centre GPU, 11 readers kept the step
# fed at nearly its in-memory rate and 8 did not; nvJPEG decoding every image made the step
# slower, its per-image work and the calls that drive it running beside the step's kernels and
# launches (docs/results.md, "ResNet-50").
PILLOW_READERS = 11


def default_cpu_decode(on_gpu: bool, workers: int) -> float:
    """The share of each batch the reader processes decode with Pillow unless told
    (``--cpu-decode``): all of it without a GPU decoder or with enough readers, else none."""
    return 1.0 if not on_gpu or workers >= PILLOW_READERS else 0.0


def check_cpu_decode(share) -> None:
    """``share`` (of each batch decoded by the reader processes) is None or from 0 to 1."""
    if share is not None and not (isinstance(share, (int, float)) and 0 <= share <= 1):
        raise GpuaccelError(f"--cpu-decode must be a fraction from 0 to 1, got {share}")


# --- the index: where each image's bytes are -------------------------------------------------------

@dataclass
class Records:
    """One split: per image a label, a display name, and where its bytes are: ``sizes[i]``
    bytes at ``offsets[i]`` of file ``paths[i]``, or of shard ``paths[shard_of[i]]``."""

    names: list[str]
    labels: np.ndarray
    paths: list[str]
    offsets: np.ndarray
    sizes: np.ndarray
    shard_of: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def sharded(self) -> bool:
        return self.shard_of is not None

    def shard_sizes(self) -> list[int]:
        return np.bincount(self.shard_of, minlength=len(self.paths)).tolist()

    def path(self, i: int) -> str:
        return self.paths[i] if self.shard_of is None else self.paths[self.shard_of[i]]

    def read(self, i: int) -> bytearray:
        buffer = bytearray(int(self.sizes[i]))
        fd = os.open(self.path(i), os.O_RDONLY)
        try:
            return buffer[:_read_fully(fd, memoryview(buffer), int(self.offsets[i]))]
        finally:
            os.close(fd)

    def subset(self, keep: np.ndarray) -> "Records":
        if self.sharded:
            return Records([self.names[i] for i in keep], self.labels[keep], self.paths, self.offsets[keep],
                           self.sizes[keep], self.shard_of[keep])
        return Records([self.names[i] for i in keep], self.labels[keep], [self.paths[i] for i in keep],
                       self.offsets[keep], self.sizes[keep])


def _read_fully(fd: int, view: memoryview, offset: int) -> int:
    """Reads len(view) bytes at ``offset`` into ``view``; returns how many there were."""
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            break  # the file is shorter than indexed: what was read fails to decode, by name
        done += count
    return done


def _folder_records(root: Path):
    """(train, test or None, classes) of an ImageFolder tree; files stay where they are."""
    names, _dirs, fingerprint = _scan_tree(root)
    size_of = {name: size for name, size, _mtime in fingerprint}
    if not names:
        raise GpuaccelError(f"{root}: the data set is empty (no image files found)")
    prefix = common_root(names)
    splits, _ = split_tree([n[len(prefix):] for n in names])
    if "train" not in splits:
        raise GpuaccelError(f"{root}: no images found in class folders (expected train/<class>/*.jpg or <class>/*.jpg)")
    classes = sorted(splits["train"])
    index = {c: i for i, c in enumerate(classes)}
    unknown = sorted(set(splits.get("test", {})) - set(classes))
    if unknown:
        raise GpuaccelError(f"{root}: test classes {unknown} do not appear in the training split")

    def records(split):
        files = [(prefix + n, index[c]) for c in sorted(splits[split]) for n in sorted(splits[split][c])]
        paths = [os.path.join(root, n) for n, _ in files]
        return Records(paths, np.array([label for _, label in files], dtype=np.int64), paths,
                       np.zeros(len(files), dtype=np.int64), np.array([size_of[n] for n, _ in files], dtype=np.int64))

    return records("train"), (records("test") if "test" in splits else None), classes


def find_shards(root: Path) -> dict[str, list[Path]] | None:
    """The .tar shards of a WebDataset-style directory by split, or None if it holds none.

    Shards in train/ and val/ (or test/) subfolders, or named *train* and *val*/*test*; any
    other shards are training shards."""
    if not root.is_dir():
        return None
    splits: dict[str, list[Path]] = {}
    for path in sorted(root.glob("*.tar")) + sorted(root.glob("*/*.tar")):
        folder = path.parent.name.lower() if path.parent != root else ""
        stem = path.stem.lower()
        if folder in TEST_SPLIT_NAMES or set(TEST_SPLIT_NAMES) & set(stem.replace("-", "_").split("_")):
            splits.setdefault("test", []).append(path)
        elif folder in ("", "train"):
            splits.setdefault("train", []).append(path)
    return splits or None


def _shard_members(path: Path):
    """(key, image member name, data offset, size, label text or None) per sample of one shard.

    A sample is the members sharing a key (the name up to its first dot): an image and
    optionally a .cls member holding its class index."""
    samples: dict[str, dict] = {}
    try:
        with tarfile.open(path, "r:") as archive:
            for member in archive:
                if not member.isfile():
                    continue
                directory, _, base = member.name.rpartition("/")
                key = (directory + "/" if directory else "") + base.split(".", 1)[0]
                entry = samples.setdefault(key, {})
                if is_image_name(member.name):
                    entry["image"] = (member.name, member.offset_data, member.size)
                elif base.endswith(".cls"):
                    entry["cls"] = archive.extractfile(member).read().decode().strip()
    except (tarfile.TarError, OSError, EOFError, UnicodeDecodeError) as exc:
        raise GpuaccelError(f"cannot read shard {path}: {exc} (shards must be uncompressed .tar files)") from None
    return [(key, *s["image"], s.get("cls")) for key, s in samples.items() if "image" in s]


def _shard_records(shards: list[Path]):
    names, labels, offsets, sizes, shard_of = [], [], [], [], []
    for number, path in enumerate(shards):
        for key, member, offset, size, cls in _shard_members(path):
            if cls is None:  # no .cls member: the folder the image sits in names its class
                folder = key.rpartition("/")[0].rpartition("/")[2]
                if not folder:
                    raise GpuaccelError(f"{path}:{member} has no .cls label member and no class folder")
                label = folder
            else:
                label = cls
            names.append(f"{path}:{member}")
            labels.append(label)
            offsets.append(offset)
            sizes.append(size)
            shard_of.append(number)
    if not names:
        raise GpuaccelError(f"{shards[0].parent}: the shards hold no images")
    return names, labels, np.array(offsets, dtype=np.int64), np.array(sizes, dtype=np.int64), \
        np.array(shard_of, dtype=np.int64)


def _shards_dataset_records(root: Path, shards: dict[str, list[Path]]):
    parts = {split: _shard_records(paths) for split, paths in shards.items()}
    all_labels = [label for part in parts.values() for label in part[1]]
    numeric = all(label.lstrip("-").isdigit() for label in all_labels)
    if numeric:
        values = [int(label) for label in all_labels]
        if min(values) < 0:
            raise GpuaccelError(f"{root}: class index {min(values)} is negative")
        names_file = root / "classes.txt"
        classes = names_file.read_text().split("\n") if names_file.exists() else []
        classes = [c.strip() for c in classes if c.strip()] or [str(i) for i in range(max(values) + 1)]
        if max(values) >= len(classes):
            raise GpuaccelError(f"{root}: class index {max(values)} but classes.txt names {len(classes)} classes")
        index = None
    else:
        classes = sorted(set(parts["train"][1]))
        index = {c: i for i, c in enumerate(classes)}
        unknown = sorted(set(all_labels) - set(classes))
        if unknown:
            raise GpuaccelError(f"{root}: test classes {unknown[:5]} do not appear in the training shards")

    def records(split):
        names, labels, offsets, sizes, shard_of = parts[split]
        values = np.array([int(x) for x in labels] if index is None else [index[x] for x in labels], dtype=np.int64)
        return Records(names, values, [str(p) for p in shards[split]], offsets, sizes, shard_of)

    return records("train"), (records("test") if "test" in parts else None), classes


# --- the order: which images each rank reads in which step -------------------------------------------

class ShardOrder:
    """Whole shards per rank, shuffled within windows of consecutive shards (see the module doc).

    Same interface as the in-memory loaders' order: ``len``, ``epoch_indices``,
    ``sample_indices``, ``batch_seed``."""

    def __init__(self, shard_sizes: list[int], *, batch_size: int, train: bool, seed: int, rank: int,
                 world_size: int, window: int = SHUFFLE_WINDOW):
        if train and len(shard_sizes) < world_size:  # (evaluation: a process without shards reads nothing)
            raise GpuaccelError(f"{len(shard_sizes)} training shard(s) cannot be split among {world_size} "
                                f"processes; write at least one shard per process")
        self.batch_size, self.train, self.seed, self.rank, self.world_size = batch_size, train, seed, rank, world_size
        self.window = window
        self.num_images = sum(shard_sizes)
        starts = np.concatenate([[0], np.cumsum(shard_sizes)])
        self._ranges = [torch.arange(int(starts[i]), int(starts[i + 1])) for i in range(len(shard_sizes))]
        # which shards each rank owns is fixed for the run; training deals them out at random
        deal = torch.randperm(len(shard_sizes), generator=torch.Generator().manual_seed(seed)) if train \
            else torch.arange(len(shard_sizes))
        owned = [deal[r::world_size].tolist() for r in range(world_size)]
        self._owned = owned[rank]
        per_rank = [sum(shard_sizes[s] for s in shards) for shards in owned]
        self.shard_size = per_rank[rank]
        self.drop_last = train
        self._steps = min(per_rank) // batch_size if train else math.ceil(self.shard_size / batch_size)
        if train and self._steps == 0:
            raise GpuaccelError(f"batch size {batch_size} is larger than the {min(per_rank)} training images "
                                f"a process owns; use a smaller --batch-size")

    def __len__(self) -> int:
        return self._steps

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        if not self.train:
            return torch.cat([torch.arange(0)] + [self._ranges[s] for s in self._owned])
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 8_191 + self.rank)
        shards = [self._owned[i] for i in torch.randperm(len(self._owned), generator=generator).tolist()]
        served = []
        for start in range(0, len(shards), self.window):
            pool = torch.cat([self._ranges[s] for s in shards[start:start + self.window]])
            served.append(pool[torch.randperm(len(pool), generator=generator)])
        return torch.cat(served)[: self._steps * self.batch_size]

    def sample_indices(self, count: int) -> torch.Tensor:
        return torch.randperm(self.num_images, generator=torch.Generator().manual_seed(self.seed))[:count]

    def batch_seed(self, epoch: int, step: int) -> int:
        return ((self.seed * 1_000_003 + epoch) * 7_919 + step) * self.world_size + self.rank


# --- reading and decoding ----------------------------------------------------------------------------------

class HostBatch(NamedTuple):
    """One batch as a reader process hands it over: the first ``len(shapes)`` images decoded
    (``pixels``: each height x width x channels, one after another), the rest still compressed
    (``compressed``: ``lengths[k]`` bytes each, one after another; ``frames`` row k: offset,
    height, width, 1 if nvJPEG's hardware decoder takes it, from its frame header, and the
    EXIF orientation), and
    the decoding failures as (position in the batch, reason)."""

    pixels: torch.Tensor
    shapes: torch.Tensor
    compressed: torch.Tensor
    lengths: torch.Tensor
    frames: torch.Tensor
    failures: list


class _FileBatches(torch.utils.data.Dataset):
    """What a reader process does: item ``ids`` (one batch) is a :class:`HostBatch` whose first
    ``round(cpu_share * len(ids))`` images are decoded with Pillow; the rest are read for nvJPEG.

    Processes rather than threads because reading takes the GIL back after every system call
    and the training thread holds it most of the time; and the share decoded here is work the GPU's decoder, which waits behind the
    training step's kernels, does not have to do. Buffers are made in shared memory, so
    handing one over does not copy it."""

    def __init__(self, records: Records, cpu_share: float):
        self.records, self.cpu_share = records, cpu_share
        self._shards: dict[int, int] = {}  # open shard files, per process

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, ids: list[int]) -> HostBatch:
        on_cpu = round(self.cpu_share * len(ids))
        decoded, failures = [], []
        for k, i in enumerate(ids[:on_cpu]):
            data = bytearray(int(self.records.sizes[i]))
            data = data[:self._read(i, memoryview(data))]
            array, reason = _decode_one(ImageSource("", data=data), None)
            if array is None:
                failures.append((k, reason))
                array = np.zeros((1, 1, 1), dtype=np.uint8)
            decoded.append(array)
        pixels = _shared_bytes(sum(a.size for a in decoded))
        view, at = pixels.numpy(), 0
        for array in decoded:
            view[at:at + array.size] = array.reshape(-1)
            at += array.size
        rest = ids[on_cpu:]
        starts = np.concatenate([[0], np.cumsum(self.records.sizes[rest])]).astype(np.int64)
        compressed = _shared_bytes(int(starts[-1]))
        target = memoryview(compressed.numpy())
        lengths, frames = [], []
        for k, i in enumerate(rest):
            lengths.append(self._read(i, target[starts[k]:starts[k + 1]]))
            header = nvjpeg.frame(target[starts[k]:starts[k] + lengths[-1]])
            frames.append((starts[k], *((header.height, header.width, header.hardware, header.orientation)
                                        if header else (0, 0, 0, 1))))
        shapes = torch.tensor([a.shape for a in decoded], dtype=torch.int64).reshape(-1, 3)
        return HostBatch(pixels, shapes, compressed, torch.tensor(lengths, dtype=torch.int64),
                         torch.tensor(frames, dtype=torch.int64).reshape(-1, 5), failures)

    def _read(self, i: int, target: memoryview) -> int:
        records = self.records
        if records.sharded:
            shard = int(records.shard_of[i])
            if shard not in self._shards:
                self._shards[shard] = os.open(records.paths[shard], os.O_RDONLY)
            return _read_fully(self._shards[shard], target, int(records.offsets[i]))
        fd = os.open(records.paths[i], os.O_RDONLY)
        try:
            return _read_fully(fd, target, 0)
        finally:
            os.close(fd)


def _shared_bytes(count: int) -> torch.Tensor:
    return torch.empty(count, dtype=torch.uint8).share_memory_()


def _decode_with_pil(data):
    """(3, H, W) uint8 tensor (grayscale repeated over RGB), or the reason it cannot be decoded."""
    array, reason = _decode_one(ImageSource("", data=data.numpy() if isinstance(data, torch.Tensor) else data), None)
    if array is None:
        return reason
    return torch.from_numpy(np.array(array)).permute(2, 0, 1).expand(3, -1, -1).contiguous()


def _decode_on_gpu(blobs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | str]:
    """Compressed images (1-D uint8 tensors) -> (3, H, W) uint8 tensors on ``device`` in one
    batched nvJPEG call. A batch nvJPEG rejects is decoded again image by image, so that one
    bad file is found and named; what nvJPEG cannot decode at all (CMYK, PNG in a JPEG
    folder) goes to Pillow."""
    from torchvision.io import ImageReadMode

    try:
        return nvjpeg.torchvision_decode(blobs, ImageReadMode.RGB, device)
    except RuntimeError:
        pass
    results: list[torch.Tensor | str] = []
    for blob in blobs:
        try:
            results.append(nvjpeg.torchvision_decode(blob, ImageReadMode.RGB, device))
        except RuntimeError:
            fallback = _decode_with_pil(blob)
            results.append(fallback if isinstance(fallback, str) else fallback.to(device))
    return results


# --- the loader -------------------------------------------------------------------------------------------

def _step_ids(order, batch_size: int, epoch: int) -> list[list[int]]:
    """The image ids of each step of ``epoch`` in ``order``."""
    ids = order.epoch_indices(epoch)
    return [ids[s * batch_size:(s + 1) * batch_size].tolist() for s in range(len(order))]


class JpegPasses:
    """The host side of a streamed split: ``workers`` reader processes (:class:`_FileBatches`)
    read each step's files into shared memory and decode ``cpu_decode`` of its images with
    Pillow, in the split's order (an image folder: :class:`loader.ShardedOrder`; shards:
    :class:`ShardOrder`), reading on into the next epoch while one ends. A step is (its seed,
    or None for evaluation; its image ids; its :class:`HostBatch`)."""

    def __init__(self, records: Records, *, batch_size: int, train: bool, seed: int, rank: int, world_size: int,
                 workers: int, cpu_decode: float, pin_memory: bool):
        if records.sharded:
            self.order = ShardOrder(records.shard_sizes(), batch_size=batch_size, train=train, seed=seed,
                                    rank=rank, world_size=world_size)
        else:
            self.order = ShardedOrder(len(records), batch_size=batch_size, train=train, seed=seed, rank=rank,
                                      world_size=world_size, drop_last=None)
        self.batch_size, self.num_images, self.workers = batch_size, len(records), workers
        step_ids = functools.partial(_step_ids, self.order, batch_size)
        self._reader = PassReader(_FileBatches(records, cpu_decode), step_ids, next_epoch(train), workers=workers,
                                  pin_memory=pin_memory, prefetch_factor=2)
        self._lock = threading.Lock()  # one pass at a time: a new pass waits for an abandoned one to stop

    def __len__(self) -> int:
        return len(self.order)

    def read(self, epoch: int, start: int) -> Iterator[tuple[int | None, list[int], HostBatch]]:
        steps = self._reader.keys(epoch)[start:]
        with self._lock:
            for number, (ids, host) in enumerate(zip(steps, self._reader.read(epoch, start))):
                yield (self.order.batch_seed(epoch, start + number) if self.order.train else None), ids, host

    def sample(self, count: int) -> tuple[None, list[int], HostBatch]:
        """The first ``count`` images of a fixed random order, as an evaluation step."""
        ids = self.order.sample_indices(count).tolist()
        return None, ids, self._reader.loader.dataset[ids]

    def stop_workers(self) -> None:
        """Stops the reader processes now (loader.py's PassReader.close); the next pass starts them."""
        self._reader.close()


class JpegBatches:
    """The device side of a streamed split: a step of :class:`JpegPasses` made into
    ``image_size`` x ``image_size`` normalised images and their labels on the device.

    Training batches are random-resized crops with random horizontal flips, drawn from the
    step's seed; evaluation batches (seed None) are centre crops. A batch is a pure function of
    (seed, epoch, step), up to the decoders' rounding. The images the readers left compressed
    are decoded by nvJPEG on the GPU (called directly through :mod:`nvjpeg`, one call per batch;
    through torchvision the images the JPEG engines cannot take, and all of them without
    engines), or without it by Pillow on the calling thread. A file that cannot be decoded stops
    the run with its name, or with ``skip_bad`` is counted in ``skipped`` and replaced by another
    image of the same batch (shapes stay static)."""

    def __init__(self, records: Records, *, device: torch.device, normaliser: Normaliser, image_size: int,
                 skip_bad: bool, skipped: dict, on_gpu: bool, cpu_decode: float):
        self.records, self.device, self.normaliser, self.image_size = records, device, normaliser, image_size
        self.skip_bad, self.skipped, self.on_gpu, self.cpu_decode = skip_bad, skipped, on_gpu, cpu_decode
        self.batch_decoder = nvjpeg.BatchDecoder.open(device) if on_gpu and cpu_decode < 1 else None
        self._in_use: collections.deque = collections.deque()  # host batches the GPU may still read
        self._in_use_lock = threading.Lock()

    @property
    def decoder(self) -> str:
        if not self.on_gpu or self.cpu_decode >= 1:
            return "pillow"
        route = self.batch_decoder.kind if self.batch_decoder else "torchvision"
        return f"nvjpeg ({route}), {self.cpu_decode:.0%} pillow"

    def __call__(self, step: tuple[int | None, list[int], HostBatch]) -> tuple[torch.Tensor, torch.Tensor]:
        """One step's (images, labels) on the device, in the training dtype and layout, made on the
        current stream."""
        seed, ids, host = step
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        return self._images(ids, generator, host, finished=True), self._labels(ids)

    def scaled(self, step: tuple[int | None, list[int], HostBatch]) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's centre crops normalised in float32 (a sample for data-dependent
        initialisation), and their labels."""
        _, ids, host = step
        return self.normaliser.scale(self._images(ids, None, host)), self._labels(ids)

    def _labels(self, ids: list[int]) -> torch.Tensor:
        labels = torch.from_numpy(self.records.labels[ids])
        # pinned: a copy from pageable memory first waits for all of this stream's work
        return (labels.pin_memory() if self.device.type == "cuda" else labels).to(self.device, non_blocking=True)

    def _decoded(self, host: HostBatch) -> tuple[ImageTable, dict[int, str]]:
        """The batch's images on the device, and the reasons of those that failed."""
        failures = dict(host.failures)
        tables = []
        if len(host.shapes):
            tables.append(ImageTable.interleaved(host.pixels.to(self.device, non_blocking=True), host.shapes.numpy()))
        frames, lengths = host.frames.numpy(), host.lengths.numpy()
        upright = frames[:, 4] == 1  # nvJPEG ignores EXIF orientation: Pillow decodes the others, upright
        direct = (frames[:, 3] == 1) & upright if self.batch_decoder is not None else np.zeros(len(frames), dtype=bool)
        order = np.concatenate([np.flatnonzero(direct), np.flatnonzero(~direct)])
        if direct.any():
            try:
                planes, starts = self.batch_decoder.decode(host.compressed, frames[direct, 0], lengths[direct],
                                                           frames[direct, 1], frames[direct, 2])
                tables.append(ImageTable.planar(planes, frames[direct, 1:3], starts))
            except RuntimeError:  # nvJPEG refused the batch: decode it again below, image by image
                order, direct = np.arange(len(frames)), np.zeros(len(frames), dtype=bool)
        rest = np.flatnonzero(~direct)
        if len(rest):
            blobs = [host.compressed[frames[k, 0]:frames[k, 0] + lengths[k]] for k in rest.tolist()]
            on_gpu = [k for k, i in enumerate(rest.tolist()) if self.on_gpu and upright[i]]
            images: list = [None] * len(rest)
            for k, image in zip(on_gpu, _decode_on_gpu([blobs[k] for k in on_gpu], self.device) if on_gpu else ()):
                images[k] = image
            for k in (k for k in range(len(rest)) if images[k] is None):  # Pillow: on the CPU, or on its side
                image = _decode_with_pil(blobs[k])
                images[k] = image if isinstance(image, str) else image.to(self.device)
            for j, image in enumerate(images):
                if isinstance(image, str):
                    failures[len(host.shapes) + int(rest[j])] = image
                    images[j] = torch.zeros(3, 1, 1, dtype=torch.uint8, device=self.device)
            tables.append(ImageTable.of(images))
        table = ImageTable.concat(tables)
        if len(order):  # back to the batch's order: the CPU-decoded images, then the compressed ones
            inverse = np.empty(len(order), dtype=np.int64)
            inverse[order] = np.arange(len(order))
            table = table.take(np.concatenate([np.arange(len(host.shapes)), len(host.shapes) + inverse]))
        if self.device.type == "cuda":  # nvJPEG may read the host buffers until its work is done
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            with self._in_use_lock:
                self._in_use.append((done, host))
                oldest = self._in_use.popleft() if len(self._in_use) > 3 else None
            if oldest is not None:
                oldest[0].synchronize()
        return table, failures

    def _images(self, ids: list[int], generator: torch.Generator | None, host: HostBatch,
                finished: bool = False) -> torch.Tensor:
        """Decoded, cropped, resized (and flipped) images of one batch: (N, 3, S, S) float, 0..255,
        or with ``finished`` normalised in the training dtype and layout (made in the same
        pass). ``generator`` None: evaluation geometry (centre crops, no flips)."""
        table, failures = self._decoded(host)
        if failures:
            bad = sorted(failures)
            names = [self.records.names[ids[k]] for k in bad]
            if not self.skip_bad:
                raise GpuaccelError(f"cannot decode image {names[0]} ({failures[bad[0]]}); fix or remove it, "
                                    f"or pass --skip-bad to skip bad images")
            for k, name in zip(bad, names):
                self.skipped[name] = failures[k]
            good = [k for k in range(len(table)) if k not in failures]
            if not good:
                raise GpuaccelError(f"no image of a batch could be decoded (first: {names[0]}: {failures[bad[0]]})")
            rows = np.arange(len(table))
            rows[bad] = [good[j % len(good)] for j in range(len(bad))]  # another image takes the bad one's place
            table = table.take(rows)
        heights, widths = torch.from_numpy(table.sizes[:, 0]), torch.from_numpy(table.sizes[:, 1])
        form = self.normaliser.finished_form if finished else {}
        if generator is None:
            return resample_boxes(table, centre_boxes(heights, widths, self.image_size), self.image_size, **form)
        boxes = random_resized_boxes(heights, widths, generator)
        flip = torch.rand(len(table), generator=generator) < 0.5
        return resample_boxes(table, boxes, self.image_size, flip, **form)


# --- the data set ----------------------------------------------------------------------------------------

@dataclass
class StreamingDataset:
    """What the trainer needs of a data set, for one that is read from files as it trains."""

    name: str
    source: str
    train: Records
    test: Records
    classes: list[str]
    image_size: int
    skipped_reasons: dict = field(default_factory=dict)

    in_channels = 3

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def train_labels(self) -> np.ndarray:
        return self.train.labels

    @property
    def test_labels(self) -> np.ndarray:
        return self.test.labels

    @property
    def skipped(self) -> list[str]:
        return sorted(self.skipped_reasons)

    @property
    def layout(self) -> str:
        return f"{len(set(self.train.paths))} shards" if self.train.sharded else "files"

    def describe(self) -> str:
        return (f"{self.name}: {len(self.train)} train / {len(self.test)} test images streamed from "
                f"{self.layout}, decoded and cropped to 3x{self.image_size}x{self.image_size} per step, "
                f"{self.num_classes} classes")

    def channel_stats(self, count: int = 256, seed: int = 0) -> tuple[list[float], list[float]]:
        """Per-channel mean and std (0..1) of ``count`` training images picked at random."""
        picked = torch.randperm(len(self.train), generator=torch.Generator().manual_seed(seed))[:count].tolist()
        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            decoded = [d for d in pool.map(lambda i: _decode_with_pil(self.train.read(i)), picked)
                       if not isinstance(d, str)]
        if not decoded:
            raise GpuaccelError(f"{self.source}: none of {len(picked)} sampled training images could be decoded")
        pixels = torch.cat([d.reshape(3, -1).double() / 255.0 for d in decoded], dim=1)
        return pixels.mean(dim=1).tolist(), pixels.std(dim=1).clamp(min=1e-3).tolist()


def open_stream(path, *, image_size: int | None = None, val_split: float | None = None,
                seed: int = 0) -> StreamingDataset:
    """Indexes an ImageFolder tree or a directory of .tar shards for streaming."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise GpuaccelError(f"streaming reads an image folder or a directory of .tar shards; {root} is not a directory")
    size = image_size or DEFAULT_IMAGE_SIZE
    if size < 16:
        raise GpuaccelError(f"--image-size must be at least 16 pixels for streamed crops, got {size}")
    shards = find_shards(root)
    if shards is not None:
        if "train" not in shards:
            raise GpuaccelError(f"{root}: no training shards (put them in train/ or name them *train*)")
        train, test, classes = _shards_dataset_records(root, shards)
    else:
        train, test, classes = _folder_records(root)
    if test is None:
        if train.sharded:
            raise GpuaccelError(f"{root}: no validation shards (put them in val/ or name them *val*); "
                                f"--val-split cannot carve images out of shards")
        train_ids, _, test_ids, _ = stratified_split(np.arange(len(train)), train.labels,
                                                     0.1 if val_split is None else val_split, seed)
        train, test = train.subset(train_ids), train.subset(test_ids)
    elif val_split is not None:
        raise GpuaccelError(f"{root} already has a validation split; --val-split is only for data without one")
    return StreamingDataset(root.name, str(root), train, test, classes, size)
