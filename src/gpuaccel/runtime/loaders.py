"""The two engines every gpuaccel loader is made of, behind both doors (``Trainer`` and
``Accelerator.prepare``), and the choosers that pick one.

Every loader is a :class:`~gpuaccel.data.source.BatchSource`: ``len()`` steps a pass,
``batches(epoch, start)`` on the device. Two engines serve one from what the data is:

:class:`ResidentLoader`: the whole data set lives on the compute device, one tensor per field,
and a batch is one gather per field: no worker processes, no host work, no copy per step. Its
order (an :class:`~gpuaccel.data.loader.ShardedOrder`, whose ``epoch_plan`` gives a pass's indices,
batch sizes and widths) is gpuaccel's seeded, sharded one (``Trainer``: resumable at any step), the
order of a user's ``DataLoader`` (its sampler, drawing the same random numbers from the same
generators, so a seeded script gets the same batches with or without it), or a data kind's own
(a text's random windows, sentences in length runs, sentence pairs in token buckets).

:class:`PrefetchLoader`: batches made on the host (by a user's ``DataLoader``, or by worker
processes in gpuaccel's seeded order: :class:`HostPasses` over a Dataset's items or over image
arrays, ``data.stream.JpegPasses`` over a streamed JPEG folder) arrive on the device one step
ahead, copied from pinned memory on a side stream, or made there ahead of the step by background
threads (JPEG decoding).

Either takes a ``transform``, run on the device on each batch (image arrays: the normalisation;
a resident loader may take a kind's ``gather`` of several batches at once instead). Both iterate
like the ``DataLoader`` they stand for, whose attributes (``dataset``, ``batch_size``,
``sampler``, ...) they keep. Whether data lives on the device is decided once, by
:func:`resident_bytes`; :func:`prepare_loader` picks a loader for a user's DataLoader,
:func:`user_loader` for the trainer's Python data, :func:`image_loader` for a data kind's image
arrays, :func:`stream_loader` for a streamed JPEG folder.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, TensorDataset
from torch.utils.data import default_collate

from ..data.augment import AugmentConfig
from ..data.loader import (DeviceCopies, EpochPlan, ImageBatches, ImageGather, Normaliser, OrderedBatches,
                           PassReader, ShardedOrder, default_workers, indices_on, next_epoch, on_device, PLACEMENTS,
                           resident_budget)
from ..data.images import gpu_jpeg_decoder_available
from ..data.prefetch import in_threads, side_stream
from ..data.source import BatchSource, is_batch_source
from ..data.stream import JpegBatches, JpegPasses, StreamingDataset, check_cpu_decode, default_cpu_decode
from ..data.tensors import _DictRows, gather_tensors, is_tensors, rows
from ..errors import GpuaccelError
from ..monitor.steps import DataWaitMeter


def laid_out(batch, layout):
    """Image batches (4-D floating tensors) in a model's memory layout: a channels-last
    convolution fed NCHW would convert its input itself, every layer."""
    if layout is None or layout is torch.contiguous_format:
        return batch
    return tree_map(lambda t: t.contiguous(memory_format=layout)
                    if isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point() else t, batch)


class _LikeDataLoader:
    """Iterates like a DataLoader (each ``iter`` the next epoch) and answers for the DataLoader
    it stands for: ``dataset``, ``batch_size``, ``sampler``, ``num_workers``, ..."""

    source: DataLoader | None = None
    layout = None
    meter: DataWaitMeter | None = None
    transform: Callable | None = None  # (run on the device on each batch; ResidentLoader also gives its seed)
    _epochs_iterated = 0

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator:
        raise NotImplementedError

    def stop_workers(self) -> None:
        """Stops the reader processes this loader started (a user's own DataLoader is left as it
        is); the next pass starts them again."""
        stop = getattr(self.__dict__.get("_passes"), "stop_workers", None)
        if stop is not None:
            stop()

    def __iter__(self) -> Iterator:
        epoch, self._epochs_iterated = self._epochs_iterated, self._epochs_iterated + 1
        batches = (laid_out(batch, self.layout) for batch in self.batches(epoch))
        return self.meter.timed(batches) if self.meter is not None else batches

    def __getattr__(self, name):
        source = self.__dict__.get("source")
        if source is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(source, name)


class ResidentLoader(_LikeDataLoader):
    """Batches of a tuple or dict of tensors with one row per sample, held on ``device``: each
    batch one gather per field. Dtypes are kept: float targets stay float.

    Which rows make each batch is the ``order``'s (its :meth:`~ShardedOrder.epoch_plan` for each
    pass): by default gpuaccel's seeded order (``batch_size``, ``train``: shuffled, ``seed``, this
    process's shard), with ``order_of`` that DataLoader's order, or a data kind's own (random
    windows of a text, sentences in length runs, pairs in token buckets), whose plan may also cut
    each batch's sequences to a width.

    What a data kind adds: ``transform(batch, seed)`` makes each gathered batch what training
    reads (normalised, augmented, token ids widened), with ``seed`` the batch's own for random
    augmentation (training batches in gpuaccel's order; None for evaluation and samples), so a
    resumed run draws what an uninterrupted one did; and ``tensors`` may be drawn again for each
    epoch (negative samples): a callable ``tensors(epoch)`` whose ``len()`` is the samples of an
    epoch. A kind whose augmentation is part of the gather brings ``gather`` instead of a
    transform: ``gather(tensors, idx, steps, epoch)`` makes the batches ``steps`` (consecutive,
    ``gather.together`` of them at a time) from their samples ``idx`` (image arrays:
    ``data.loader.ImageGather``). ``sample_transform``: what :meth:`sample` applies, where it
    differs from the transform."""

    resident = True  # (what a script asks of a prepared loader: its data set lives on the device)

    def __init__(self, tensors, *, device: torch.device, batch_size: int | None = None, train: bool = False,
                 seed: int = 0, rank: int = 0, world_size: int = 1, drop_last: bool | None = None,
                 order: ShardedOrder | None = None, order_of: DataLoader | None = None, layout=None,
                 meter: DataWaitMeter | None = None, transform: Callable | None = None,
                 gather: Callable | None = None, sample_transform: Callable | None = None):
        redrawn = callable(tensors)
        if order is None:
            count = len(tensors) if redrawn else rows(tensors)
            order = _DataLoaderOrder(order_of, count) if order_of is not None else \
                ShardedOrder(count, batch_size=batch_size, train=train, seed=seed, rank=rank, world_size=world_size,
                             drop_last=drop_last)
        self.order, self.source = order, order_of
        self.device, self.layout, self.meter, self.transform = device, layout, meter, transform
        self.gather, self.sample_transform = gather, sample_transform
        self.tensors = tensors if redrawn else on_device(tensors, device)

    def __len__(self) -> int:
        return len(self.order)

    # what a loader is asked for, as its order has it
    batch_size = property(lambda self: self.order.batch_size)
    train = property(lambda self: self.order.train)
    num_images = property(lambda self: self.order.num_images)
    drop_last = property(lambda self: self.order.drop_last)

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator:
        tensors = self._tensors_of(epoch)
        plan = self.order.epoch_plan(epoch, self.device)
        if self.gather is not None:
            yield from self._gathered_together(tensors, plan, epoch, start)
            return
        indices = _batches_of(plan)
        widths = plan.widths or [None] * len(plan.sizes)
        seeded = self.transform is not None and self.train and self.source is None  # (only a transform reads it)
        for step in range(start, len(plan.sizes)):
            yield self._gathered(tensors, indices[step], widths[step],
                                 self.order.batch_seed(epoch, step) if seeded else None)

    def sample(self, count: int):
        """The first ``count`` samples of a fixed random order, as one batch on the device."""
        idx = self.order.sample_indices(count).to(self.device)
        if self.sample_transform is not None:
            return self.sample_transform(_rows_of(self._tensors_of(0), idx, None))
        return self._gathered(self._tensors_of(0), idx, None, None)

    def shape_examples(self) -> list:
        """One batch of each shape training makes, where the order's batches vary in shape
        (token buckets): the warm-up compiles and records each before the clock starts."""
        plan = self.order.shapes_plan(self.device)
        if plan is None:
            return []
        return [self._gathered(self._tensors_of(0), idx, width, None)
                for idx, width in zip(_batches_of(plan), plan.widths)]

    def _tensors_of(self, epoch: int):
        return self.tensors(epoch) if callable(self.tensors) else self.tensors

    def _gathered(self, tensors, idx: torch.Tensor, width: int | None, seed: int | None):
        batch = _rows_of(tensors, idx, width)
        return batch if self.transform is None else self.transform(batch, seed)

    def _gathered_together(self, tensors, plan: EpochPlan, epoch: int, start: int) -> Iterator:
        """The pass from batch ``start`` made by the kind's gather, ``gather.together`` batches at a time."""
        ends = list(itertools.accumulate(plan.sizes, initial=0))
        steps, together = len(plan.sizes), self.gather.together
        for first in range(start, steps, together):
            group = range(first, min(first + together, steps))
            yield from self.gather(tensors, plan.indices[ends[first]:ends[group.stop]], group, epoch)


def _rows_of(tensors, idx: torch.Tensor, width: int | None):
    """Rows ``idx`` of every tensor of a tuple or dict, cut to ``width`` (:func:`_gather`)."""
    if type(tensors) is tuple and all(isinstance(t, torch.Tensor) for t in tensors):  # (without tree_map's cost)
        return tuple(_gather(t, idx, width) for t in tensors)
    return tree_map(lambda t: _gather(t, idx, width) if isinstance(t, torch.Tensor) else t, tensors)


def _batches_of(plan: EpochPlan) -> tuple[torch.Tensor, ...]:
    """Each batch's indices, as views of the pass's (one call, not a slice per step); indices past
    the last batch (a dropped ragged one) are left out."""
    return plan.indices[:sum(plan.sizes)].split(plan.sizes)


def _gather(t: torch.Tensor, idx: torch.Tensor, width: int | None) -> torch.Tensor:
    """Rows ``idx`` of ``t``; a plan's ``width`` cuts fields of two or more dimensions (sequences)."""
    return t[idx] if width is None or t.dim() < 2 else t[idx, :width]


class _DataLoaderOrder(ShardedOrder):
    """A user's DataLoader's order, for its data set made resident: its sampler's batches,
    drawing the random numbers its iterator would, in its order."""

    def __init__(self, loader: DataLoader, count: int):
        super().__init__(count, batch_size=loader.batch_size, train=False, seed=0, rank=0, world_size=1,
                         drop_last=loader.drop_last)
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def epoch_plan(self, epoch: int, device: torch.device) -> EpochPlan:
        loader = self.loader
        # the random numbers a DataLoader's iterator draws, in its order: its workers' base seed
        # (not again for persistent workers after their first epoch), then the sampler's own
        if not (loader.persistent_workers and loader.num_workers > 0 and epoch > 0):
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        batches = [torch.as_tensor(list(indices), dtype=torch.int64) for indices in loader.batch_sampler]
        if not batches:
            return EpochPlan(torch.empty(0, dtype=torch.int64, device=device), [])
        return EpochPlan(indices_on(torch.cat(batches), device), [len(b) for b in batches])


class _DataLoaderPasses:
    """A user's DataLoader as the host side of a :class:`PrefetchLoader`: each epoch iterates it
    once (``set_epoch`` on its sampler first, as DistributedSampler wants); a resumed epoch skips
    its first ``start`` batches."""

    def __init__(self, loader: DataLoader):
        try:
            self.steps = len(loader)
        except TypeError:
            raise GpuaccelError("a DataLoader over an IterableDataset needs a length (define __len__ on the "
                                "dataset) so that the schedule and the epochs can be planned") from None
        self.loader = loader
        self.batch_size = loader.batch_size
        self.num_images = len(loader.dataset) if hasattr(loader.dataset, "__len__") else None

    def __len__(self) -> int:
        return self.steps

    def read(self, epoch: int, start: int) -> Iterator:
        for holder in (getattr(self.loader, "sampler", None), getattr(self.loader, "batch_sampler", None),
                       self.loader.dataset):
            if hasattr(holder, "set_epoch"):
                holder.set_epoch(epoch)
        host = iter(self.loader)
        for _ in range(start):
            next(host, None)
        return host


class HostPasses(ShardedOrder):
    """Batches made on the host by ``workers`` persistent processes into pinned memory, in
    gpuaccel's seeded, sharded order: ``items(order)`` is the Dataset of what a worker makes,
    item (epoch, step) that step's batch (:class:`DatasetBatches`: a Dataset's samples,
    collated; ``data.loader.ImageBatches``: image arrays, gathered and augmented)."""

    def __init__(self, items: Callable[[ShardedOrder], OrderedBatches], num_samples: int, *, batch_size: int,
                 train: bool, seed: int, rank: int, world_size: int, drop_last: bool | None, workers: int | None,
                 pin_memory: bool):
        super().__init__(num_samples, batch_size=batch_size, train=train, seed=seed, rank=rank,
                         world_size=world_size, drop_last=drop_last)
        # the workers get a plain copy of the order, not this object with its reader
        self.items = items(ShardedOrder(num_samples, batch_size=batch_size, train=train, seed=seed, rank=rank,
                                        world_size=world_size, drop_last=self.drop_last))
        steps = len(self)
        self._reader = PassReader(self.items, lambda epoch: [(epoch, step) for step in range(steps)],
                                  next_epoch(train), workers=default_workers() if workers is None else workers,
                                  pin_memory=pin_memory, prefetch_factor=4)

    def read(self, epoch: int, start: int) -> Iterator:
        return self._reader.read(epoch, start)

    def sample(self, count: int):
        return self.items.at(self.sample_indices(count))

    def stop_workers(self) -> None:
        self._reader.close()


class DatasetBatches(OrderedBatches):
    """A map-style Dataset's samples, collated into batches."""

    def __init__(self, order: ShardedOrder, dataset: Dataset, collate=default_collate):
        super().__init__(order)
        self.dataset, self.collate = dataset, collate

    def at(self, idx: torch.Tensor, epoch: int | None = None, step: int = 0):
        return self.collate([self.dataset[int(i)] for i in idx])


class PrefetchLoader(_LikeDataLoader):
    """Batches made on the host arriving on ``device``: from pinned memory, copied one step ahead
    of their use on a side stream (the consuming stream waits for each copy). ``passes``: a user's
    DataLoader, or worker processes in gpuaccel's order (:class:`HostPasses`, or a streamed
    split's ``data.stream.JpegPasses``).

    With ``threads`` > 0 the ``transform`` takes each host batch as it is (it copies what it needs
    itself) and runs ahead of the consumer, on that many background threads, each on a side
    stream of its own (``data.prefetch.in_threads``): for device work too heavy to run between
    two training steps on the consuming thread (decoding JPEGs with nvJPEG, which waits for its
    per-image work)."""

    resident = False

    def __init__(self, passes: DataLoader | HostPasses, device: torch.device, *, layout=None,
                 meter: DataWaitMeter | None = None, transform: Callable | None = None,
                 sample_transform: Callable | None = None, threads: int = 0):
        self.source = passes if isinstance(passes, DataLoader) else None
        self._passes = _DataLoaderPasses(passes) if isinstance(passes, DataLoader) else passes
        self.device, self.layout, self.meter, self.transform = device, layout, meter, transform
        self.sample_transform = sample_transform or transform  # (:meth:`sample`'s, where it differs)
        self._copies = DeviceCopies(device)
        # one stream per thread, kept for the loader's life (prefetch.side_stream says why)
        self._sides = [side_stream(device) for _ in range(threads)]
        # check(batch, where) of each host batch before it is copied, for loaders made with
        # checks_batches (the Trainer's check of a user's targets, which a loader that never holds the
        # whole data set cannot have checked before)
        self.checks_batches = False
        self._host_check: Callable | None = None
        self._unchecked: list[tuple] = []  # (batch, epoch, index) read before the check was set

    def __len__(self) -> int:
        return len(self._passes)

    @property
    def passes(self):
        """What makes the batches on the host (a user's DataLoader's are iterated as they are)."""
        return self._passes

    @property
    def num_images(self) -> int | None:
        return self._passes.num_images

    @property
    def batch_size(self) -> int | None:
        return self._passes.batch_size

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator:
        if start >= len(self):
            return iter(())
        host = self._passes.read(epoch, start)
        if self.checks_batches:
            self._unchecked = []
            host = self._checked(host, epoch, start)
        if self._sides:
            return in_threads(host, self.transform, self._sides)
        batches = self._copies(host)
        return batches if self.transform is None else map(self.transform, batches)

    def sample(self, count: int):
        """The first ``count`` samples of a fixed random order, as one batch on the device (not
        augmented); for batches gpuaccel's worker processes make, not a user's DataLoader's."""
        if not hasattr(self._passes, "sample"):
            raise GpuaccelError("a user's DataLoader has no fixed sample of its data set to give")
        batch = self._passes.sample(count)
        batch = batch if self._sides else on_device(batch, self.device)  # (made ahead: its transform copies)
        return batch if self.sample_transform is None else self.sample_transform(batch)

    @property
    def host_check(self) -> Callable | None:
        return self._host_check

    @host_check.setter
    def host_check(self, check: Callable | None) -> None:
        """Sets the check; the batches already read ahead (the first and the one copied ahead of
        its use) are checked at once."""
        self._host_check, unchecked, self._unchecked = check, self._unchecked, []
        for batch, epoch, index in unchecked if check is not None else ():
            check(batch, _batch_name(epoch, index))

    def _checked(self, batches: Iterable, epoch: int, start: int) -> Iterator:
        for index, batch in enumerate(batches, start):
            if self._host_check is not None:
                self._host_check(batch, _batch_name(epoch, index))
            elif len(self._unchecked) < 2:
                self._unchecked.append((batch, epoch, index))
            yield batch


def _batch_name(epoch: int, index: int) -> str:
    return f"batch {index + 1} of epoch {epoch + 1}"


def resident_bytes(device: torch.device, placement: str = "auto") -> float:
    """How many bytes of a data set may live on ``device``: the one decision of where data lives,
    for every loader. ``placement`` 'gpu': any (the data set must fit); 'cpu': none (worker
    processes read it on the host); 'auto': half of a GPU's free memory, or a quarter of the
    host's memory for the CPU."""
    if placement not in PLACEMENTS:
        raise GpuaccelError(f"the loader placement is one of {', '.join(PLACEMENTS)}, not {placement!r}")
    if placement != "auto":
        return float("inf") if placement == "gpu" else 0.0
    return resident_budget(device)


def image_loader(images: torch.Tensor, labels: torch.Tensor, *, device: torch.device, mean, std, batch_size: int,
                 train: bool, placement: str = "auto", workers: int | None = None, dtype: torch.dtype = torch.float32,
                 augment: AugmentConfig | None = None, channels_last: bool = False, seed: int = 0,
                 drop_last: bool | None = None, rank: int = 0, world_size: int = 1) -> ResidentLoader | PrefetchLoader:
    """A data kind's uint8 (N, C, H, W) images and int64 labels as batches of normalised images:
    resident, made several batches at a time with their augmentation on the device
    (``data.loader.ImageGather``), where :func:`resident_bytes` allows; otherwise gathered and
    augmented as uint8 by ``workers`` processes on the host, copied ahead and normalised on the
    device (the same batches, up to uint8 rounding: ``data.loader.ImageBatches``)."""
    order = dict(batch_size=batch_size, train=train, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last)
    normaliser = Normaliser(mean, std, device, dtype, channels_last)
    if images.numel() * images.element_size() < resident_bytes(device, placement):
        sharded = ShardedOrder(len(labels), **order)
        gather = ImageGather(sharded, normaliser, augment, images.shape[1:], device)
        # (a sample for data-dependent initialisation is normalised in float32, not cast or augmented)
        return ResidentLoader((images, labels), device=device, order=sharded, gather=gather,
                              sample_transform=normaliser.scaled_batch)
    # shared memory: workers started by fork or spawn read the images without a copy
    host_images, host_labels = images.cpu().share_memory_(), labels.cpu().share_memory_()
    passes = HostPasses(lambda o: ImageBatches(o, host_images, host_labels, augment, mean), len(labels),
                        workers=workers, pin_memory=device.type == "cuda", **order)
    return PrefetchLoader(passes, device, transform=normaliser.batch, sample_transform=normaliser.scaled_batch)


def stream_loader(dataset: StreamingDataset, *, train: bool, batch_size: int, device: torch.device, mean, std,
                  dtype: torch.dtype = torch.float32, channels_last: bool = False, seed: int = 0, rank: int = 0,
                  world_size: int = 1, skip_bad: bool = False, workers: int | None = None,
                  cpu_decode: float | None = None, threads: int = 1) -> PrefetchLoader:
    """A streamed JPEG split (an image folder or .tar shards) as batches of ``dataset.image_size``
    normalised images: read, and a share decoded, by reader processes on the host
    (``data.stream.JpegPasses``); the rest decoded by nvJPEG, cropped, resized, flipped and
    normalised on the device by ``threads`` background threads ahead of the training step
    (``data.stream.JpegBatches``), the step waiting only on a CUDA event.

    ``workers``: by default all cores but two (which stay with the training and pipeline
    threads); ``workers=0`` reads in the pipeline's thread. ``cpu_decode``: the share the readers
    decode with Pillow, by default ``data.stream.default_cpu_decode`` (all, or none where nvJPEG
    is at hand and the readers are fewer than ``PILLOW_READERS``). ``threads``: one by default;
    two overlap two decoding calls, which beside training wait for nvJPEG's per-image work, but
    gained nothing end to end for ResNet-50 (docs/results.md); the batches and their order do
    not depend on it."""
    if threads < 1:
        raise GpuaccelError(f"the streaming loader needs at least one pipeline thread, got {threads}")
    records = dataset.train if train else dataset.test
    on_gpu = gpu_jpeg_decoder_available(device)
    workers = default_workers(reserved=2, limit=None) if workers is None else workers
    check_cpu_decode(cpu_decode)
    cpu_decode = default_cpu_decode(on_gpu, workers) if cpu_decode is None else cpu_decode
    passes = JpegPasses(records, batch_size=batch_size, train=train, seed=seed, rank=rank, world_size=world_size,
                        workers=workers, cpu_decode=cpu_decode, pin_memory=device.type == "cuda")
    made = JpegBatches(records, device=device, normaliser=Normaliser(mean, std, device, dtype, channels_last),
                       image_size=dataset.image_size, skip_bad=skip_bad, skipped=dataset.skipped_reasons,
                       on_gpu=on_gpu, cpu_decode=cpu_decode)
    return PrefetchLoader(passes, device, transform=made, sample_transform=made.scaled, threads=threads)


def dataset_loader(dataset: Dataset, *, batch_size: int, device: torch.device, train: bool, seed: int = 0,
                   rank: int = 0, world_size: int = 1, drop_last: bool | None = None, workers: int | None = None,
                   collate=default_collate) -> PrefetchLoader:
    """A map-style Dataset's batches made by worker processes in gpuaccel's seeded, sharded order
    (resumable at any step), prefetched onto ``device``."""
    passes = HostPasses(lambda order: DatasetBatches(order, dataset, collate), len(dataset), batch_size=batch_size,
                        train=train, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last,
                        workers=workers, pin_memory=device.type == "cuda")
    return PrefetchLoader(passes, device)


def user_loader(data, *, batch_size: int, device: torch.device, train: bool, placement: str = "auto",
                workers: int | None = None, seed: int = 0, rank: int = 0, world_size: int = 1):
    """The trainer's loader for one split of a user's data: a :class:`BatchSource` of the user's
    own is used as it is; tensors, and a Dataset whose samples fit (:func:`resident_bytes`) and
    do not change between reads, live on the device; other Datasets are read by worker
    processes; a DataLoader is taken as ``Accelerator.prepare`` takes one (:func:`prepare_loader`:
    its data set resident where safe, in the DataLoader's own order; else iterated as it is,
    each process given a DistributedSampler where it has none). ``placement`` 'cpu' keeps any of
    them on the host."""
    if is_batch_source(data):
        return SourceOnDevice(data, device)
    loader = _user_loader(data, batch_size=batch_size, device=device, train=train, placement=placement,
                          workers=workers, seed=seed, rank=rank, world_size=world_size)
    if isinstance(loader, PrefetchLoader):
        loader.checks_batches = True  # (read batch by batch: the trainer checks each one as it arrives)
    return loader


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t`` is on ``device`` (``cuda`` meaning the current GPU)."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


class SourceOnDevice(_LikeDataLoader):
    """A user's own :class:`BatchSource`, its batches on ``device`` (moved there where they are
    not yet); its other attributes its own. The trainer reads it through ``batches``; prepared
    by ``Accelerator.prepare`` it iterates like a DataLoader (each ``iter`` the next pass), its
    waits timed by ``meter``."""

    def __init__(self, source: BatchSource, device: torch.device, *, layout=None,
                 meter: DataWaitMeter | None = None):
        self.source, self.device, self.layout, self.meter = source, device, layout, meter

    def __len__(self) -> int:
        return len(self.source)

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator:
        for batch in self.source.batches(epoch, start):
            yield on_device(batch, self.device)


def _user_loader(data, *, batch_size: int, device: torch.device, train: bool, placement: str, workers: int | None,
                 seed: int, rank: int, world_size: int):
    order = dict(batch_size=batch_size, device=device, train=train, seed=seed, rank=rank, world_size=world_size)
    if isinstance(data, DataLoader):  # (every process draws the seed's order, to take disjoint shards of it)
        return prepare_loader(data, device, resident=False if placement == "cpu" else None, rank=rank,
                              world_size=world_size, shared_seed=lambda: seed)
    if isinstance(data, IterableDataset):
        return PrefetchLoader(DataLoader(data, batch_size=batch_size), device)
    budget = resident_bytes(device, placement)
    if is_tensors(data):
        # (tensors already on the device stay there; the others count against what may join them)
        moved = sum(t.numel() * t.element_size() for t in tree_flatten(data)[0]
                    if isinstance(t, torch.Tensor) and not _on(t, device))
        if moved and budget <= moved:
            rows_of = TensorDataset(*data) if isinstance(data, (tuple, list)) else _DictRows(data)
            return dataset_loader(rows_of, workers=workers, **order)
        return ResidentLoader(data, **order)
    if isinstance(data, Dataset):
        tensors = gather_tensors(data, budget) if budget > 0 else None
        if tensors is not None:
            return ResidentLoader(tensors, **order)
        return dataset_loader(data, workers=workers, **order)
    raise GpuaccelError(f"training data is a gpuaccel data spec, a torch Dataset, a DataLoader, a tuple/dict of "
                        f"tensors or a BatchSource, not {type(data).__name__}")


def prepare_loader(loader: DataLoader, device: torch.device, *, resident: bool | None, layout=None,
                   meter: DataWaitMeter | None = None, rank: int = 0, world_size: int = 1,
                   shared_seed=None) -> ResidentLoader | PrefetchLoader:
    """A user's DataLoader ready for ``device``, for ``Accelerator.prepare``.

    Resident (``resident`` True, or None and it is safe): its data set, read once through its
    items, lives on the device and batches follow the DataLoader's own sampler. Safe means a
    map-style data set of tensors batched by PyTorch's default collation whose items read the
    same twice (no random augmentation inside ``__getitem__``) and that takes at most half of the
    free device memory; reading it draws no random numbers of the script's. Otherwise the
    DataLoader runs as it is and its batches are prefetched. With several processes, a DataLoader
    without a DistributedSampler gets one (or, resident, a shard of a seeded order agreed by every
    process: ``shared_seed()``)."""
    dataset = loader.dataset
    gatherable = not isinstance(dataset, IterableDataset) and loader.batch_size is not None and \
        (loader.collate_fn is default_collate or resident)
    tensors = None
    if resident is not False and gatherable:
        tensors = gather_tensors(dataset, resident_bytes(device),
                                 workers=max(loader.num_workers, default_workers() if len(dataset) > 4096 else 0))
        if tensors is None and resident:
            raise GpuaccelError("device_resident=True: the data set's items do not stack into tensors that fit on "
                                "the device (or they change from one read to the next)")
    elif resident and not gatherable:
        raise GpuaccelError("device_resident=True needs a map-style Dataset batched by the default collate_fn")
    distributed_sampler = isinstance(loader.sampler, DistributedSampler)
    if tensors is not None:
        if world_size > 1 and not distributed_sampler:
            # every process must draw the same order to take disjoint shards of it
            return ResidentLoader(tensors, batch_size=loader.batch_size, device=device,
                                  train=isinstance(loader.sampler, RandomSampler), drop_last=loader.drop_last,
                                  rank=rank, world_size=world_size, seed=shared_seed(), layout=layout, meter=meter)
        return ResidentLoader(tensors, batch_size=loader.batch_size, device=device, train=False, order_of=loader,
                              layout=layout, meter=meter)
    if world_size > 1 and not distributed_sampler and not isinstance(dataset, IterableDataset):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                     shuffle=isinstance(loader.sampler, RandomSampler))
        loader = DataLoader(dataset, batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
                            collate_fn=loader.collate_fn, pin_memory=device.type == "cuda", drop_last=loader.drop_last,
                            persistent_workers=loader.persistent_workers, worker_init_fn=loader.worker_init_fn,
                            generator=loader.generator)
    return PrefetchLoader(loader, device, layout=layout, meter=meter)
