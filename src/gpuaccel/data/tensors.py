"""A user's own data as tensors: how many rows it has, whether it is tensors at all, a seeded
held-out split, and a map-style Dataset gathered into one tensor per field (when it fits and
its items do not change from one read to the next). The loaders that serve such data on the
device are in ``gpuaccel.runtime.loaders``.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset, default_collate

from ..errors import GpuaccelError


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
    ``__getitem__`` (by ``workers`` processes) and collated; None when it would take more than
    ``max_bytes``, when items differ in shape (they cannot be stacked), or when reading an item
    twice gives different values (random augmentation inside the data set: it must keep running
    per step). Reading draws none of the process's random numbers (they are put back)."""
    if isinstance(dataset, TensorDataset):
        return dataset.tensors if tree_bytes(dataset.tensors) <= max_bytes else None
    if isinstance(dataset, Subset) and isinstance(dataset.dataset, TensorDataset):
        index = torch.as_tensor(dataset.indices)
        tensors = tuple(t[index] for t in dataset.dataset.tensors)
        return tensors if tree_bytes(tensors) <= max_bytes else None
    if len(dataset) == 0:
        raise GpuaccelError("the data set is empty")
    with _random_state_kept():
        first = default_collate([dataset[0]])
        if tree_bytes(first) * len(dataset) > max_bytes or not _reads_the_same(dataset):
            return None
    parts = []
    reader = DataLoader(dataset, batch_size=1024, num_workers=workers, collate_fn=default_collate,
                        generator=torch.Generator())  # (its workers' seeds from its own generator)
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


def _reads_the_same(dataset: Dataset, probes: int = 8) -> bool:
    """Whether items read twice are equal, for ``probes`` items spread over the data set (a random
    flip alone passes one such check half of the time; eight, once in 256)."""
    n = len(dataset)
    for i in sorted({round(k * (n - 1) / max(1, probes - 1)) for k in range(probes)}):
        if not _same(default_collate([dataset[i]]), default_collate([dataset[i]])):
            return False
    return True


@contextlib.contextmanager
def _random_state_kept():
    """Random numbers drawn inside (by a data set's transforms) are given back: torch's, Python's
    and NumPy's generators leave as they came."""
    import random

    import numpy as np

    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])


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


class _DictRows(Dataset):
    """A dict of tensors as a map-style Dataset of dict rows."""

    def __init__(self, tensors: dict):
        self.tensors, self.n = tensors, rows(tensors)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.tensors.items()}
