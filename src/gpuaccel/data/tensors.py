"""Loaders for a user's own data: tensors, a map-style ``torch.utils.data.Dataset``, or a
``DataLoader`` / ``IterableDataset``, with batches as tuples or dicts of tensors.

The fast path is the same as for images: a data set whose tensors fit is gathered once
into one tensor per field and lives on the compute device (:class:`TensorLoader`): a step
is one gather per field, with no host work and no copy. A data set that does not fit, or
whose items change from one read to the next (random augmentation inside ``__getitem__``),
is read by worker processes into pinned memory and copied to the device one step ahead on
a side stream (:class:`DatasetLoader`). A user's ``DataLoader`` is iterated as it is, with
the same copy ahead (:class:`IterableLoader`).

All three serve ``batches(epoch, start)`` like the image loaders, so the trainer and a
resumed run treat them alike; the first two give each rank its shard of a seeded order.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, TensorDataset, default_collate

from ..errors import GpuaccelError
from .loader import DeviceCopies, PassReader, _next_epoch, _ShardedOrder, default_workers, resident_budget


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def rows(tensors) -> int:
    """The common first dimension of a tuple/dict of tensors (an error if they differ)."""
    leaves = [t for t in tree_flatten(tensors)[0] if _is_tensor(t)]
    if not leaves:
        raise GpuaccelError("the data holds no tensors")
    sizes = {int(t.shape[0]) for t in leaves}
    if len(sizes) != 1:
        raise GpuaccelError(f"the data's tensors differ in length ({', '.join(map(str, sorted(sizes)))} rows); "
                            f"every field needs one row per sample")
    return sizes.pop()


def tree_bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if _is_tensor(t))


class TensorLoader(_ShardedOrder):
    """Shuffled (training) or ordered (evaluation) batches of a tuple or dict of tensors with
    one row per sample, held on the compute device. Dtypes are kept: float targets stay float."""

    def __init__(self, tensors, *, batch_size: int, device: torch.device, train: bool, seed: int = 0,
                 rank: int = 0, world_size: int = 1, drop_last: bool | None = None):
        super().__init__(rows(tensors), batch_size=batch_size, train=train, seed=seed, rank=rank,
                         world_size=world_size, drop_last=drop_last)
        self.device = device
        self.tensors = tree_map(lambda t: t.to(device) if _is_tensor(t) else t, tensors)

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator:
        order = self.epoch_indices(epoch).to(self.device)
        for step in range(start, len(self)):
            idx = order[step * self.batch_size:(step + 1) * self.batch_size]
            yield tree_map(lambda t: t[idx] if _is_tensor(t) else t, self.tensors)


class _DatasetBatches(Dataset):
    """What a worker process computes: item (epoch, step) is that batch, collated."""

    def __init__(self, order: _ShardedOrder, dataset: Dataset, collate):
        self.order, self.dataset, self.collate = order, dataset, collate
        self._epoch, self._indices = None, None

    def __getitem__(self, key):
        epoch, step = key
        if epoch != self._epoch:
            self._epoch, self._indices = epoch, self.order.epoch_indices(epoch)
        idx = self._indices[step * self.order.batch_size:(step + 1) * self.order.batch_size]
        return self.collate([self.dataset[int(i)] for i in idx])


class DatasetLoader(_ShardedOrder):
    """Batches of a map-style Dataset read by ``workers`` persistent processes, in the same
    seeded, sharded order as the device loaders, copied to the device one step ahead."""

    def __init__(self, dataset: Dataset, *, batch_size: int, device: torch.device, train: bool, seed: int = 0,
                 rank: int = 0, world_size: int = 1, drop_last: bool | None = None, workers: int | None = None,
                 collate=default_collate):
        super().__init__(len(dataset), batch_size=batch_size, train=train, seed=seed, rank=rank,
                         world_size=world_size, drop_last=drop_last)
        self.device = device
        workers = default_workers() if workers is None else workers
        order = _ShardedOrder(self.num_images, batch_size=batch_size, train=train, seed=seed, rank=rank,
                              world_size=world_size, drop_last=self.drop_last)
        steps = len(self)
        self._reader = PassReader(_DatasetBatches(order, dataset, collate),
                                  lambda epoch: [(epoch, step) for step in range(steps)], _next_epoch(train),
                                  workers=workers, pin_memory=device.type == "cuda", prefetch_factor=4)
        self._copies = DeviceCopies(device)

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator:
        if start >= len(self):
            return iter(())
        return self._copies(self._reader.read(epoch, start))


class IterableLoader:
    """A user's ``DataLoader`` (or an ``IterableDataset``, batched by one) as it is: each epoch
    iterates it once (``set_epoch`` on its sampler first, as DistributedSampler wants), copies
    batches to the device one step ahead, and skips ``start`` batches on a resume."""

    def __init__(self, loader: DataLoader, *, device: torch.device):
        try:
            self.steps = len(loader)
        except TypeError:
            raise GpuaccelError("a DataLoader over an IterableDataset needs a length (define __len__ on the "
                                "dataset) so that the schedule and the epochs can be planned") from None
        self.loader, self.device = loader, device
        self.batch_size = loader.batch_size
        self.num_images = len(loader.dataset) if hasattr(loader.dataset, "__len__") else None
        self._copies = DeviceCopies(device)

    def __len__(self) -> int:
        return self.steps

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator:
        for holder in (getattr(self.loader, "sampler", None), getattr(self.loader, "batch_sampler", None),
                       self.loader.dataset):
            if hasattr(holder, "set_epoch"):
                holder.set_epoch(epoch)
        host = iter(self.loader)
        for _ in range(start):
            next(host, None)
        return self._copies(host)


def _same(a, b) -> bool:
    leaves_a, spec_a = tree_flatten(a)
    leaves_b, spec_b = tree_flatten(b)
    if spec_a != spec_b:
        return False
    for x, y in zip(leaves_a, leaves_b):
        if _is_tensor(x) != _is_tensor(y):
            return False
        if _is_tensor(x) and (x.shape != y.shape or not torch.equal(x, y)):
            return False
        if not _is_tensor(x) and x != y:
            return False
    return True


def gather_tensors(dataset: Dataset, max_bytes: float, workers: int = 0):
    """The whole data set as a tuple/dict of tensors (one row per sample), read once through
    ``__getitem__`` and collated; None when it would take more than ``max_bytes``, when items
    differ in shape (they cannot be stacked), or when reading an item twice gives different
    values (random augmentation inside the data set: it must keep running per step)."""
    if isinstance(dataset, TensorDataset):
        return dataset.tensors if tree_bytes(dataset.tensors) <= max_bytes else None
    if isinstance(dataset, Subset) and isinstance(dataset.dataset, TensorDataset):
        index = torch.as_tensor(dataset.indices)
        tensors = tuple(t[index] for t in dataset.dataset.tensors)
        return tensors if tree_bytes(tensors) <= max_bytes else None
    if len(dataset) == 0:
        raise GpuaccelError("the data set is empty")
    first = default_collate([dataset[0]])
    if tree_bytes(first) * len(dataset) > max_bytes or not _same(first, default_collate([dataset[0]])):
        return None
    parts = []
    reader = DataLoader(dataset, batch_size=1024, num_workers=workers, collate_fn=default_collate)
    try:
        for batch in reader:
            parts.append(batch)
    except RuntimeError as exc:  # default_collate: "stack expects each tensor to be equal size"
        if "equal size" in str(exc) or "same size" in str(exc) or "stack expects" in str(exc):
            return None
        raise
    leaves = [tree_flatten(p)[0] for p in parts]
    spec = tree_flatten(parts[0])[1]
    if any(not _is_tensor(x) for x in leaves[0]):
        return None
    try:
        return tree_unflatten([torch.cat(column) for column in zip(*leaves)], spec)
    except RuntimeError:
        return None


def split_off(data, fraction: float, seed: int):
    """(train, held-out) parts of tensors or a map-style Dataset: a seeded random ``fraction``."""
    if not 0.0 < fraction < 1.0:
        raise GpuaccelError(f"--val-split must be between 0 and 1 (exclusive), got {fraction}")
    n = rows(data) if not isinstance(data, Dataset) else len(data)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    held = max(1, int(round(n * fraction)))
    if held >= n:
        raise GpuaccelError(f"{n} samples are too few to hold out {fraction:g} of them for evaluation; "
                            f"pass eval_data")
    test_idx, train_idx = order[:held].sort().values, order[held:].sort().values
    if isinstance(data, Dataset):
        return Subset(data, train_idx.tolist()), Subset(data, test_idx.tolist())
    return (tree_map(lambda t: t[train_idx] if _is_tensor(t) else t, data),
            tree_map(lambda t: t[test_idx] if _is_tensor(t) else t, data))


def is_tensors(data) -> bool:
    """Tensors as training data: a tensor tuple/list or a dict of tensors (not a Dataset)."""
    if isinstance(data, (Dataset, DataLoader)) or data is None:
        return False
    leaves = tree_flatten(data)[0]
    return bool(leaves) and all(_is_tensor(t) for t in leaves) and isinstance(data, (tuple, list, dict))


def build_user_loader(data, *, batch_size: int, device: torch.device, train: bool, placement: str = "auto",
                      workers: int | None = None, seed: int = 0, rank: int = 0, world_size: int = 1):
    """The loader for one split of a user's data (see the module's docstring)."""
    order = dict(batch_size=batch_size, device=device, train=train, seed=seed, rank=rank, world_size=world_size)
    if isinstance(data, DataLoader):
        return IterableLoader(data, device=device)
    if isinstance(data, IterableDataset):
        return IterableLoader(DataLoader(data, batch_size=batch_size), device=device)
    if is_tensors(data):
        if placement == "cpu" and device.type == "cuda":
            return DatasetLoader(TensorDataset(*data) if isinstance(data, (tuple, list)) else _DictRows(data),
                                 workers=workers, **order)
        return TensorLoader(data, **order)
    if isinstance(data, Dataset):
        tensors = None if placement == "cpu" else gather_tensors(data, resident_budget(device))
        if tensors is not None:
            return TensorLoader(tensors, **order)
        return DatasetLoader(data, workers=workers, **order)
    raise GpuaccelError(f"training data is a gpuaccel data spec, a torch Dataset, a DataLoader or a tuple/dict "
                        f"of tensors, not {type(data).__name__}")


class _DictRows(Dataset):
    """A dict of tensors as a map-style Dataset of dict rows."""

    def __init__(self, tensors: dict):
        self.tensors, self.n = tensors, rows(tensors)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.tensors.items()}
