"""The two device loaders behind both doors (``Trainer`` and ``Accelerator.prepare``).

:class:`ResidentLoader`: the whole data set lives on the compute device, one tensor per field,
and a batch is one gather per field: no worker processes, no host work, no copy per step. Its
order is gpuaccel's seeded, sharded one (``Trainer``: resumable at any step), or the order of a
user's ``DataLoader`` (its sampler, drawing the same random numbers from the same generators,
so a seeded script gets the same batches with or without it).

:class:`PrefetchLoader`: batches made on the host (by a user's ``DataLoader``, or by worker
processes reading a ``Dataset`` in gpuaccel's seeded order) arrive on the device one step
ahead, copied from pinned memory on a side stream.

Both serve ``batches(epoch, start)`` (the trainer's interface) and iterate like the
``DataLoader`` they stand for, whose attributes (``dataset``, ``batch_size``, ``sampler``, ...)
they keep. :func:`prepare_loader` picks one for a DataLoader; :func:`user_loader` for the
trainer's Python data.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, TensorDataset
from torch.utils.data import default_collate

from ..data.loader import DeviceCopies, PassReader, next_epoch, ShardedOrder, default_workers, resident_budget
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


class ResidentLoader(_LikeDataLoader, ShardedOrder):
    """Batches of a tuple or dict of tensors with one row per sample, held on ``device``. Dtypes
    are kept: float targets stay float. By default in gpuaccel's seeded order, shuffled for
    training, this process's shard of it; with ``order_of``, in that DataLoader's order."""

    resident = True  # (what a script asks of a prepared loader: its data set lives on the device)

    def __init__(self, tensors, *, batch_size: int, device: torch.device, train: bool, seed: int = 0,
                 rank: int = 0, world_size: int = 1, drop_last: bool | None = None,
                 order_of: DataLoader | None = None, layout=None, meter: DataWaitMeter | None = None):
        if order_of is not None:  # (its batch size and drop_last)
            batch_size, drop_last, train = order_of.batch_size, order_of.drop_last, False
        ShardedOrder.__init__(self, rows(tensors), batch_size=batch_size, train=train, seed=seed, rank=rank,
                              world_size=world_size, drop_last=drop_last)
        self.device, self.layout, self.meter, self.source = device, layout, meter, order_of
        self.tensors = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tensors)

    def __len__(self) -> int:
        return len(self.source) if self.source is not None else ShardedOrder.__len__(self)

    def _epoch_order(self, epoch: int) -> tuple[torch.Tensor, list[int]]:
        """(every index of the epoch, in order, on the device; the batch sizes)."""
        if self.source is None:
            sizes = [self.batch_size] * len(self)
            if not self.drop_last and len(self):
                sizes[-1] = self.shard_size - self.batch_size * (len(self) - 1)
            return self.device_indices(epoch, self.device), sizes
        loader = self.source
        # the random numbers a DataLoader's iterator draws, in its order: its workers' base seed
        # (not again for persistent workers after their first epoch), then the sampler's own
        if not (loader.persistent_workers and loader.num_workers > 0 and epoch > 0):
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        batches = [torch.as_tensor(list(indices), dtype=torch.int64) for indices in loader.batch_sampler]
        if not batches:
            return torch.empty(0, dtype=torch.int64, device=self.device), []
        return torch.cat(batches).to(self.device), [len(b) for b in batches]

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator:
        order, sizes = self._epoch_order(epoch)
        ends = list(itertools.accumulate(sizes))
        for step in range(start, len(sizes)):
            idx = order[ends[step] - sizes[step]:ends[step]]
            yield tree_map(lambda t: t[idx] if isinstance(t, torch.Tensor) else t, self.tensors)


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


class _DatasetPasses(ShardedOrder):
    """A map-style Dataset read by ``workers`` persistent processes into pinned memory, in
    gpuaccel's seeded, sharded order, each batch collated in a worker."""

    def __init__(self, dataset: Dataset, *, batch_size: int, train: bool, seed: int, rank: int, world_size: int,
                 drop_last: bool | None, workers: int | None, pin_memory: bool, collate=default_collate):
        super().__init__(len(dataset), batch_size=batch_size, train=train, seed=seed, rank=rank,
                         world_size=world_size, drop_last=drop_last)
        order = ShardedOrder(self.num_images, batch_size=batch_size, train=train, seed=seed, rank=rank,
                             world_size=world_size, drop_last=self.drop_last)
        steps = len(self)
        self._reader = PassReader(_DatasetBatches(order, dataset, collate),
                                  lambda epoch: [(epoch, step) for step in range(steps)], next_epoch(train),
                                  workers=default_workers() if workers is None else workers, pin_memory=pin_memory,
                                  prefetch_factor=4)

    def read(self, epoch: int, start: int) -> Iterator:
        return self._reader.read(epoch, start)

    def stop_workers(self) -> None:
        self._reader.close()


class _DatasetBatches(Dataset):
    """What a worker process computes: item (epoch, step) is that batch, collated."""

    def __init__(self, order: ShardedOrder, dataset: Dataset, collate):
        self.order, self.dataset, self.collate = order, dataset, collate
        self._epoch, self._indices = None, None

    def __getitem__(self, key):
        epoch, step = key
        if epoch != self._epoch:
            self._epoch, self._indices = epoch, self.order.epoch_indices(epoch)
        idx = self._indices[step * self.order.batch_size:(step + 1) * self.order.batch_size]
        return self.collate([self.dataset[int(i)] for i in idx])


class PrefetchLoader(_LikeDataLoader):
    """Batches made on the host arriving on ``device``: from pinned memory, copied one step ahead
    of their use on a side stream (the consuming stream waits for each copy). ``passes``: a user's
    DataLoader, or :func:`dataset_loader`'s worker processes."""

    resident = False

    def __init__(self, passes: DataLoader | _DatasetPasses, device: torch.device, *, layout=None,
                 meter: DataWaitMeter | None = None):
        self.source = passes if isinstance(passes, DataLoader) else None
        self._passes = _DataLoaderPasses(passes) if isinstance(passes, DataLoader) else passes
        self.device, self.layout, self.meter = device, layout, meter
        self._copies = DeviceCopies(device)
        # check(batch, where) of each host batch before it is copied, for loaders made with
        # checks_batches (the Trainer's check of a user's targets, which a loader that never holds the
        # whole data set cannot have checked before)
        self.checks_batches = False
        self._host_check: Callable | None = None
        self._unchecked: list[tuple] = []  # (batch, epoch, index) read before the check was set

    def __len__(self) -> int:
        return len(self._passes)

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
        return self._copies(host)

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


def dataset_loader(dataset: Dataset, *, batch_size: int, device: torch.device, train: bool, seed: int = 0,
                   rank: int = 0, world_size: int = 1, drop_last: bool | None = None, workers: int | None = None,
                   collate=default_collate) -> PrefetchLoader:
    """A map-style Dataset's batches made by worker processes in gpuaccel's seeded, sharded order
    (resumable at any step), prefetched onto ``device``."""
    passes = _DatasetPasses(dataset, batch_size=batch_size, train=train, seed=seed, rank=rank, world_size=world_size,
                            drop_last=drop_last, workers=workers, pin_memory=device.type == "cuda", collate=collate)
    return PrefetchLoader(passes, device)


def user_loader(data, *, batch_size: int, device: torch.device, train: bool, placement: str = "auto",
                workers: int | None = None, seed: int = 0, rank: int = 0, world_size: int = 1):
    """The trainer's loader for one split of a user's data: tensors, or a Dataset whose samples fit
    and do not change between reads, live on the device (``placement`` 'cpu' keeps them on the
    host); other Datasets are read by worker processes; a DataLoader is iterated as it is."""
    loader = _user_loader(data, batch_size=batch_size, device=device, train=train, placement=placement,
                          workers=workers, seed=seed, rank=rank, world_size=world_size)
    if isinstance(loader, PrefetchLoader):
        loader.checks_batches = True  # (read batch by batch: the trainer checks each one as it arrives)
    return loader


def _user_loader(data, *, batch_size: int, device: torch.device, train: bool, placement: str, workers: int | None,
                 seed: int, rank: int, world_size: int):
    order = dict(batch_size=batch_size, device=device, train=train, seed=seed, rank=rank, world_size=world_size)
    if isinstance(data, DataLoader):
        return PrefetchLoader(data, device)
    if isinstance(data, IterableDataset):
        return PrefetchLoader(DataLoader(data, batch_size=batch_size), device)
    if is_tensors(data):
        if placement == "cpu" and device.type == "cuda":
            rows_of = TensorDataset(*data) if isinstance(data, (tuple, list)) else _DictRows(data)
            return dataset_loader(rows_of, workers=workers, **order)
        return ResidentLoader(data, **order)
    if isinstance(data, Dataset):
        tensors = None if placement == "cpu" else gather_tensors(data, resident_budget(device))
        if tensors is not None:
            return ResidentLoader(tensors, **order)
        return dataset_loader(data, workers=workers, **order)
    raise GpuaccelError(f"training data is a gpuaccel data spec, a torch Dataset, a DataLoader or a tuple/dict "
                        f"of tensors, not {type(data).__name__}")


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
        tensors = gather_tensors(dataset, resident_budget(device),
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
