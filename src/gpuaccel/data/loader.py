"""What gpuaccel's loaders are made of: their order, and how image arrays become batches.

:class:`ShardedOrder` is the order every loader serves samples in: batches are a pure function
of (seed, epoch) and each batch's augmentation of (seed, epoch, step), so training can stop at
any step and resume at the next one with the same data; with ``world_size`` > 1 each rank
takes a disjoint shard of every epoch's permutation.

:class:`ImageGather` is how a resident loader (``runtime.loaders.ResidentLoader``, a whole split
of images as one uint8 tensor on the compute device) makes image batches: on a GPU a gather, a
few augmentation ops and a normalisation make several batches at once: no host work, no
host-device copy, no synchronisation.

For images that do not fit in GPU memory (``--loader cpu`` forces it), :class:`ImageBatches`
is what worker processes make (:class:`PassReader`): the same batches gathered and augmented
on the CPU as uint8; ``runtime.loaders`` copies them to the GPU one step ahead
(:class:`DeviceCopies`) and normalises them there (uint8 crosses the bus, a quarter of fp32).
"""

from __future__ import annotations

import atexit
import math
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..background import stop_at_exit
from .augment import (AugmentConfig, AugmentDraws, alternate_flips, apply_pixel_changes, augment_batch,
                      gather_moved, resize)

_EPOCH_SALT = 1_000_003
_STEP_SALT = 7_919
PLACEMENTS = ("auto", "gpu", "cpu")
# fp32 images a device loader on a GPU prepares at once (several batches of small images): bounds
# the working memory of its gather, normalisation and augmentation
_BYTES_TOGETHER = 64 * 2 ** 20


class _InBackground(threading.Thread):
    """``fn(*args)`` on a thread of its own, started at once; ``result()`` waits for it. (torch's
    permutation releases the GIL, so the training loop goes on meanwhile.)"""

    def __init__(self, fn, *args):
        super().__init__(name="gpuaccel-order", daemon=True)
        self.fn, self.args, self.value, self.error = fn, args, None, None
        self.start()
        stop_at_exit(self, lambda thread: thread.join(timeout=5.0))  # (an epoch's order takes milliseconds)

    def run(self):
        try:
            self.value = self.fn(*self.args)
        except BaseException as error:  # (raised again where the result is read)
            self.error = error

    def result(self):
        self.join()
        if self.error is not None:
            raise self.error
        return self.value


@dataclass
class EpochPlan:
    """One pass of a rank's batches, as a resident loader gathers them: the sample indices of the
    pass in the order served (one tensor, copied to the device once), each batch's number of
    samples, and, for sequences padded to one width, each batch's width (its fields of two or
    more dimensions are cut to it: the batch's longest sequence, or its length bucket)."""

    indices: torch.Tensor
    sizes: list[int]
    widths: list[int] | None = None


def indices_on(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host indices on ``device`` without making the host wait: on a GPU copied from pinned
    memory (a copy from pageable memory first waits for all queued work, so the GPU would idle
    while the host launches the next steps)."""
    if device.type != "cuda" or indices.device.type == "cuda":
        return indices.to(device)
    return indices.pin_memory().to(device, non_blocking=True)


def int64_fields(batch: tuple, seed=None) -> tuple:
    """A batch of token ids kept narrow on the device (int32: half the memory) as the int64 ids
    embeddings and losses take: a resident loader's transform."""
    return tuple(t.long() for t in batch)


class ShardedOrder:
    """The order every gpuaccel loader serves samples in: which ones each rank serves, in which
    seeded order per epoch, in how many batches (so that a run stopped at any step resumes at
    the next with the same data). Loaders subclass it or hold one; a resident loader asks it
    for each pass's :meth:`epoch_plan`, which a kind's own order (random windows, length runs,
    token buckets) overrides."""

    def __init__(self, num_images: int, *, batch_size: int, train: bool, seed: int, rank: int, world_size: int,
                 drop_last: bool | None):
        self.num_images, self.batch_size, self.train, self.seed = num_images, batch_size, train, seed
        self.rank, self.world_size = rank, world_size
        # dropping the ragged last batch keeps every training step the same shape (compile, graphs)
        self.drop_last = (train and self.shard_size > batch_size) if drop_last is None else drop_last
        self._ahead: tuple | None = None  # (the next epoch's key, its order being drawn: device_indices)

    @property
    def shard_size(self) -> int:
        """Images per rank per epoch. Training pads the permutation so every rank has as many;
        evaluation splits the images exactly, so shards differ by at most one."""
        if self.train:
            return math.ceil(self.num_images / self.world_size)
        return len(range(self.rank, self.num_images, self.world_size))

    def __len__(self) -> int:
        if self.drop_last:
            return self.shard_size // self.batch_size
        return math.ceil(self.shard_size / self.batch_size)

    def epoch_generator(self, epoch: int) -> torch.Generator:
        """The host generator an epoch's order is drawn from (a loader that draws more after it,
        e.g. the order of its batches, goes on with the same one)."""
        return torch.Generator().manual_seed(self.seed * _EPOCH_SALT + epoch)

    def epoch_indices(self, epoch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """This rank's image indices for ``epoch``, in the order they are served (drawn from
        ``generator``, by default :meth:`epoch_generator`'s)."""
        if not self.train:
            return torch.arange(self.rank, self.num_images, self.world_size)
        generator = generator if generator is not None else self.epoch_generator(epoch)
        order = torch.randperm(self.num_images, generator=generator)
        total = self.shard_size * self.world_size
        if total > self.num_images:  # wrap around so all ranks take the same number of steps
            order = torch.cat([order, order[: total - self.num_images]])
        return order[self.rank::self.world_size]

    def device_indices(self, epoch: int, device: torch.device) -> torch.Tensor:
        """:meth:`epoch_indices` on ``device``, for loaders whose data lives there, without making
        the host wait for the device: the permutation was drawn in the background while the last
        epoch trained (drawing one of millions of samples takes the host 0.1-0.2 s), and it is
        copied by :func:`indices_on`."""
        key = (epoch, self.seed, self.num_images, self.rank, self.world_size, self.train)
        ahead = self._ahead
        order = ahead[1].result() if ahead is not None and ahead[0] == key else self.epoch_indices(epoch)
        if self.train:
            following = (epoch + 1, *key[1:])
            self._ahead = (following, _InBackground(self.epoch_indices, epoch + 1))
        return indices_on(order, device)

    def epoch_plan(self, epoch: int, device: torch.device) -> EpochPlan:
        """This rank's batches of ``epoch``: batches of ``batch_size`` in :meth:`device_indices`'
        order, the last one ragged unless dropped."""
        sizes = [self.batch_size] * len(self)
        if not self.drop_last and sizes:
            sizes[-1] = self.shard_size - self.batch_size * (len(self) - 1)
        return EpochPlan(self.device_indices(epoch, device), sizes)

    def shapes_plan(self, device: torch.device) -> EpochPlan | None:
        """One batch of each shape training makes, where an order's batches vary in shape (token
        buckets: the warm-up compiles and records each before the clock); None where they do not."""
        return None

    def sample_indices(self, count: int) -> torch.Tensor:
        """The first ``count`` images of a fixed random order (for data-dependent initialisation)."""
        return torch.randperm(self.num_images, generator=torch.Generator().manual_seed(self.seed))[:count]

    def batch_seed(self, epoch: int, step: int) -> int:
        return (self.seed * _EPOCH_SALT + epoch) * _STEP_SALT + step * self.world_size + self.rank


class Normaliser:
    """uint8 (or float in 0..255) batch -> normalised batch in the training dtype and layout."""

    def __init__(self, mean, std, device: torch.device, dtype: torch.dtype, channels_last: bool):
        shape = (1, -1, 1, 1)
        self.mean = torch.tensor(mean, dtype=torch.float32, device=device).view(shape) * 255.0
        self.inv_std = 1.0 / (torch.tensor(std, dtype=torch.float32, device=device).view(shape) * 255.0)
        self.dtype, self.channels_last = dtype, channels_last
        # the same as (2, C) scale and shift, for a producer that normalises as it writes
        self.affine = torch.stack([self.inv_std.flatten(), -(self.mean * self.inv_std).flatten()])
        self.pixel_range = 255.0 * self.inv_std  # the full 0..255 range, normalised (colour jitter's unit)

    @property
    def finished_form(self) -> dict:
        """What a producer that finishes the batch itself is asked for (``crops.resample_boxes``'
        keywords): this normalisation, dtype and layout."""
        return {"affine": self.affine, "dtype": self.dtype, "channels_last": self.channels_last}

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() - self.mean) * self.inv_std

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def batch(self, batch: tuple) -> tuple:
        """(uint8 images, labels) on the device -> (normalised images, labels): the transform of
        image batches made on the host."""
        x, *rest = batch
        return (self.finish(self.scale(x)), *rest)

    def scaled_batch(self, batch: tuple) -> tuple:
        """(uint8 images, labels) -> (normalised float32 images, labels), not cast or laid out."""
        x, *rest = batch
        return (self.scale(x), *rest)


class ImageGather:
    """How a resident loader makes batches of image arrays (uint8 (N, C, H, W) images and int64
    labels): normalised, and in training augmented, several consecutive batches at once.

    On a GPU a gather, a few augmentation ops and a normalisation make :attr:`together` batches
    (each with its own draws, so every batch is what it would be alone): one set of kernels for
    them all, where each batch alone took some thirty small kernels and their launches between
    two training steps (cifar10-fast's on 4 GPUs: 384 images a batch). Crops and flips are one
    gather of the stored uint8 images, normalised after (the same values as normalising, padding,
    cropping and flipping, with a quarter of the bytes moved), which a transform after a plain
    gather could not be. A :class:`ResidentLoader` calls it with each group's indices."""

    def __init__(self, order: ShardedOrder, normaliser: Normaliser, augment: AugmentConfig | None,
                 image_shape: torch.Size, device: torch.device):
        self.order, self.normaliser, self.device, self.image_shape = order, normaliser, device, tuple(image_shape)
        self.augment = augment if (order.train and augment is not None and augment.active) else None
        # batches made at once: on a GPU up to _BYTES_TOGETHER of fp32 images (one batch of large
        # images). On a CPU one: a kernel costs little there, and several batches' images outgrow
        # its caches (cifar-sized batches together were slower)
        image_bytes = 4 * math.prod(self.image_shape)
        self.together = max(1, _BYTES_TOGETHER // (image_bytes * order.batch_size)) if device.type == "cuda" else 1

    def __call__(self, tensors: tuple[torch.Tensor, torch.Tensor], idx: torch.Tensor, steps: range,
                 epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches ``steps`` of ``epoch``, whose samples are ``idx`` (their indices one after
        another), as (images, labels) on the device."""
        images, labels = tensors
        size, augment = self.order.batch_size, self.augment
        if augment is None:
            x = self.normaliser.scale(images[idx])
        else:
            draws = AugmentDraws.joined([
                AugmentDraws.draw((min(size, len(idx) - k * size), *self.image_shape), augment,
                                  torch.Generator(device=self.device).manual_seed(self.order.batch_seed(epoch, step)),
                                  self.device) for k, step in enumerate(steps)])
            x = gather_moved(images, idx, augment, draws, alternate_flips(idx, epoch, augment, self.order.seed))
            x = apply_pixel_changes(self.normaliser.scale(x), augment, draws, unit=self.normaliser.pixel_range)
        x, labels = self.normaliser.finish(x), labels[idx]
        for k, step in enumerate(steps):
            batch = x[k * size:(k + 1) * size]
            if augment is not None:
                batch = resize(batch, augment.size_at(epoch + step / len(self.order)))
            yield batch, labels[k * size:(k + 1) * size]


class OrderedBatches(torch.utils.data.Dataset):
    """What a worker process computes: item (epoch, step) is that step's batch in ``order``.
    Subclasses say what the batch of some sample indices is (:meth:`at`)."""

    def __init__(self, order: ShardedOrder):
        self.order = order
        self._epoch, self._indices = None, None

    def __getitem__(self, key: tuple[int, int]):
        epoch, step = key
        if epoch != self._epoch:
            self._epoch, self._indices = epoch, self.order.epoch_indices(epoch)
        return self.at(self._indices[step * self.order.batch_size:(step + 1) * self.order.batch_size], epoch, step)

    def at(self, idx: torch.Tensor, epoch: int | None = None, step: int = 0):
        """The batch of samples ``idx``: as step ``step`` of ``epoch`` makes it, or unaugmented
        (``epoch`` None: a sample for data-dependent initialisation)."""
        raise NotImplementedError


class ImageBatches(OrderedBatches):
    """Batches of uint8 image arrays, gathered and augmented on the CPU: the batches of
    :class:`ImageGather` before normalisation. Cutout fills with the mean pixel (what a zero
    after normalisation is), so they equal the resident loader's up to uint8 rounding inside
    cutout squares, and (brightness, contrast, resizing, which work on uint8 here) up to
    rounding and clipping to 0..255."""

    def __init__(self, order: ShardedOrder, images: torch.Tensor, labels: torch.Tensor,
                 augment: AugmentConfig | None, mean):
        super().__init__(order)
        self.images, self.labels = images, labels
        self.augment = augment if (order.train and augment is not None and augment.active) else None
        self.fill = torch.tensor(mean).view(1, -1, 1, 1).mul(255).round().to(torch.uint8)
        self.mean_pixel = self.fill.float()  # colour jitter's centre, on the uint8 scale

    def at(self, idx: torch.Tensor, epoch: int | None = None, step: int = 0):
        x = self.images[idx]
        if self.augment is not None and epoch is not None:
            generator = torch.Generator().manual_seed(self.order.batch_seed(epoch, step))
            x = augment_batch(x, idx, epoch, self.augment, self.order.seed, generator, self.fill,
                              size=self.augment.size_at(epoch + step / len(self.order)),
                              unit=255.0, mean=self.mean_pixel)
        return x, self.labels[idx]


class _Passes(torch.utils.data.Sampler):
    """The keys of the steps of pass ``start[0]`` from step ``start[1]`` on, then of each
    following pass while there is one (see :class:`PassReader`)."""

    def __init__(self, keys: Callable[[int], list], following: Callable[[int], int | None]):
        self._make_keys, self.following = keys, following
        self._made: dict[int, list] = {}  # the passes of the last two keys() calls: reading, and read ahead
        self.start = (0, 0)

    def keys(self, epoch: int) -> list:
        if epoch not in self._made:  # (a permutation of the whole data set: made once per pass)
            while len(self._made) > 1:
                del self._made[next(iter(self._made))]  # the oldest
            self._made[epoch] = self._make_keys(epoch)
        return self._made[epoch]

    def __iter__(self):
        epoch, step = self.start
        while epoch is not None:
            keys = self.keys(epoch)
            if not keys:
                return
            yield from keys[step:]
            epoch, step = self.following(epoch), 0


class PassReader:
    """The items of a map-style ``dataset`` for the steps of one pass after another, made by
    ``workers`` persistent processes (a PyTorch DataLoader) that read on into the next pass
    while one ends, so an epoch starts with its first batches made rather than with every
    process starting on one.

    ``keys(epoch)`` lists the dataset keys of a pass's steps; ``following(epoch)`` is the
    pass made after ``epoch`` (the next epoch in training), or None to stop after it. A pass
    asked for elsewhere than where the processes stand (a resumed run, a pass left
    unfinished) drops what they made ahead and starts them there. ``keys`` and ``following``
    should not hold the object that owns the reader: the workers stop when it is freed.
    """

    def __init__(self, dataset: torch.utils.data.Dataset, keys: Callable[[int], list],
                 following: Callable[[int], int | None], *, workers: int, pin_memory: bool, prefetch_factor: int):
        self._passes = _Passes(keys, following)
        self.loader = torch.utils.data.DataLoader(
            dataset, batch_size=None, sampler=self._passes, num_workers=workers, pin_memory=pin_memory,
            persistent_workers=workers > 0, prefetch_factor=prefetch_factor if workers > 0 else None,
            worker_init_fn=_yield_to_the_training_process if workers > 0 else None)
        self._items: Iterator | None = None
        self._next: tuple[int, int] | None = None  # the (epoch, step) _items hands over next, if known

    def keys(self, epoch: int) -> list:
        """The dataset keys of the steps of pass ``epoch``."""
        return self._passes.keys(epoch)

    def read(self, epoch: int, start: int = 0) -> Iterator:
        """The items of steps ``start``.. of pass ``epoch``; one pass at a time."""
        steps = len(self._passes.keys(epoch))
        if self._items is None or self._next != (epoch, start):
            self._passes.start = (epoch, start)
            first = self._items is None
            self._items = iter(self.loader)  # persistent workers: drops what they made ahead
            if first and self.loader.num_workers:
                # after the exit handlers that PyTorch registered with the workers, so before
                # them at exit (last in, first out): torch 2.11's wait 5 s for each worker
                # that nobody told to stop
                atexit.register(_close, weakref.ref(self))
        for step in range(start, steps):
            self._next = None  # unknown if the DataLoader raises
            item = next(self._items)
            if step + 1 < steps:
                self._next = (epoch, step + 1)
            else:
                following = self._passes.following(epoch)
                self._next = None if following is None else (following, 0)
            yield item

    def close(self) -> None:
        """Stops the worker processes; the next read starts them again."""
        self._items = self._next = None
        self.loader._iterator = None  # the DataLoader holds the iterator of persistent workers; freeing it stops them


READER_NICENESS = 10  # added to the reader processes' nice value


def _yield_to_the_training_process(worker_id: int) -> None:
    """Run in each reader process as it starts: lowers its scheduling priority, so that where
    the cores are all busy (readers decoding JPEGs with Pillow) the training process's threads,
    which launch the GPU's work, run first; an idle core still runs a reader at once."""
    try:
        os.nice(READER_NICENESS)
    except OSError:  # (a platform or container that refuses it: run at the same priority)
        pass


def _close(reader: "weakref.ref[PassReader]") -> None:
    if (alive := reader()) is not None:
        alive.close()


def on_device(batch, device: torch.device, non_blocking: bool = False):
    """``batch`` (a tensor, or a tuple, list or dict of them) with its tensors on ``device``."""
    return tree_map(lambda t: t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t, batch)


class DeviceCopies:
    """Moves host batches to the device one step ahead of their use: on a GPU, from pinned
    memory on a side stream, the consuming stream waiting for each copy; elsewhere in place."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _to_device(self, batch):
        if self.stream is None:
            return on_device(batch, self.device)
        with torch.cuda.stream(self.stream):
            return on_device(batch, self.device, non_blocking=True)

    def __call__(self, host_batches: Iterator) -> Iterator:
        pending = next(host_batches, None)
        pending = None if pending is None else self._to_device(pending)
        while pending is not None:
            if self.stream is not None:
                current = torch.cuda.current_stream(self.device)
                current.wait_stream(self.stream)
                for t in tree_flatten(pending)[0]:
                    if isinstance(t, torch.Tensor):
                        t.record_stream(current)
            ready = pending
            following = next(host_batches, None)
            pending = None if following is None else self._to_device(following)  # the next batch's copy
            yield ready


def next_epoch(train: bool) -> Callable[[int], int | None]:
    """What a :class:`PassReader` reads after a pass: the next epoch in training; nothing
    after an evaluation pass (its processes would hold the next one's batches until then)."""
    return (lambda epoch: epoch + 1) if train else (lambda epoch: None)


def default_workers(reserved: int = 1, limit: int | None = 8) -> int:
    """Loader processes per training process: the cores shared among the local ranks, less
    ``reserved`` for the training process's own threads, at least one, at most ``limit``."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    share = (os.cpu_count() or 2) // local_ranks - reserved
    return max(1, share if limit is None else min(limit, share))


def resident_budget(device: torch.device, share: float = 0.5) -> float:
    """Bytes a data set may take to live on ``device``: ``share`` of a GPU's free memory, or a
    quarter of the host's memory for the CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return share * free
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 4
    except (ValueError, OSError, AttributeError):
        return 2 * 2**30
