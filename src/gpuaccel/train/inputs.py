"""What the trainer trains on, opened into one :class:`TrainingInputs`: data of a registered
kind (``config.data.source``: its kind, ``gpuaccel/kinds/``, reads it), a data set a gpuaccel reader
made, or a user's own data (a torch Dataset, a DataLoader, tensors, or a ``BatchSource``).

``TrainingInputs`` says what the model factory may be offered (image data: classes, channels,
size; text: the vocabulary and context length), what a checkpoint records to recognise the
data on resume, which task the data implies, and builds the two loaders once the model's
layout and the precision are known.
"""

from __future__ import annotations

import hashlib
import json

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..data import ImageDataset, StreamingDataset, cache, parse_spec
from ..data.kinds import kind_named, setting_kinds
from ..data.source import is_batch_source
from ..data.tensors import is_tensors, split_off
from ..errors import GpuaccelError
from ..runtime.loaders import user_loader
from .config import SCHEMA, TrainConfig

USER_DATA = "python"  # config.data.source of a run whose data came through the Python API


@dataclass
class TrainingInputs:
    name: str
    description: str
    train_samples: int | None
    test_samples: int | None
    model_args: dict = field(default_factory=dict)  # offered to the model factory
    identity: dict = field(default_factory=dict)  # recorded in checkpoints; a resume must find the same
    classes: list[str] | None = None
    mean: list[float] | None = None  # image data: the normalisation folded into the loaders
    std: list[float] | None = None
    images: ImageDataset | StreamingDataset | None = None
    task: str | None = None  # the task the data implies (None: the user must say)
    tokenizer: dict | None = None  # text data: how text becomes tokens (recorded for generation)
    unit: str = "samples"  # what one sample is called in reports: images, windows, ...
    default_model: str | None = None  # the model for data other than images when none is named
    tokens_per_sample: int | None = None  # text: throughput is also reported in tokens
    audio: dict | None = None  # recordings: the rate and length a model's input has (recorded for inference)
    ratings: dict | None = None  # ratings: each index's original user and item id (recorded for recommend)
    build: Callable = None  # (config, device, dtype, channels_last, rank, world_size) -> (train, eval) loaders
    # the training loader -> the arguments of a model's data-dependent ``data_init`` (None: the data offers none)
    init_sample: Callable | None = None
    data_kind: str | None = None  # the registered kind that read the data (recorded: deployment asks it)
    task_args: dict = field(default_factory=dict)  # offered to the task (translation: the tokeniser, references)
    record: dict = field(default_factory=dict)  # more of what a checkpoint records for deployment, by key
    shapes_vary: bool = False  # batches come in several shapes by design: compiled with symbolic sizes, once

    def content_digest(self) -> str:
        """A digest of what the data hold, for processes to compare at start: the identity, and
        for decoded images every label and an evenly spread sample of the pixels (so two
        different data sets of one shape and size differ)."""
        digest = hashlib.sha256(json.dumps(self.identity, sort_keys=True, default=str).encode())
        images = self.images
        if images is not None and getattr(images, "train_images", None) is not None:
            for array in (images.train_labels, images.test_labels):
                digest.update(np.ascontiguousarray(array).tobytes())
            for array in (images.train_images, images.test_images):
                digest.update(np.ascontiguousarray(array[::max(1, len(array) // 64)]).tobytes())
        return digest.hexdigest()[:16]

    @property
    def skipped(self) -> int:
        """Samples skipped as unreadable so far (a streamed data set finds them as it reads)."""
        return len(self.images.skipped) if self.images is not None else 0

    def loaders(self, config: TrainConfig, **placement):
        return self.build(config, **placement)

    def check_same(self, recorded: dict | None, run_dir) -> None:
        """A resume refuses data that changed since the run began, saying what changed."""
        if not recorded:
            return
        for key, was in recorded.items():
            now = self.identity.get(key)
            if now != was:
                raise GpuaccelError(f"the data changed since {run_dir} began: its {key.replace('_', ' ')} "
                                    f"{_short(was)} is now {_short(now)}; resume with the run's data or start "
                                    f"a new run")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def open_inputs(config: TrainConfig, *, dataset=None, train_data=None, eval_data=None,
                dist=None) -> TrainingInputs:
    if train_data is not None:
        if dataset is not None:
            raise GpuaccelError("pass either dataset= (a gpuaccel image data set) or train_data=, not both")
        if isinstance(train_data, (ImageDataset, StreamingDataset)):
            dataset = train_data
        else:
            return _user_inputs(train_data, eval_data, config)
    elif eval_data is not None:
        raise GpuaccelError("eval_data= needs train_data=")
    if dataset is not None:
        return kind_named("images").inputs_of(dataset)
    if config.data.source == USER_DATA:
        raise GpuaccelError("this run's data came through the Python API; pass the same train_data= "
                            "(and eval_data=) again")
    fmt, path = parse_spec(config.data.source)
    kind = kind_named(fmt)
    if config.data.loader == "stream" and not getattr(kind, "streams", False):
        raise GpuaccelError(f"--loader stream reads image folders; {fmt} data is read once and kept on the "
                            f"device (use --loader auto, gpu or cpu)")
    check_kind_settings(kind, config)
    inputs = kind.open(config, path, fmt, dist=dist)
    inputs.data_kind = inputs.data_kind or kind.name
    return inputs


def check_kind_settings(kind, config: TrainConfig) -> None:
    """Refuses, in one line, settings of other kinds' option groups (``DataKind.option_group``)
    given for this kind's data (changed from their defaults): ``--tokenizer bpe`` for an image
    folder would otherwise be silently ignored."""
    owners = setting_kinds()
    foreign = [name for name in owners if name not in kind.option_group and config.get(name) != SCHEMA[name].default]
    if foreign:
        said = "; ".join(f"--{name.replace('_', '-')} is a setting of {' and '.join(owners[name])} data"
                         for name in foreign)
        raise GpuaccelError(f"{said}, not of {kind.name} data ({config.data.source}); leave "
                            f"{'it' if len(foreign) == 1 else 'them'} out")


def shared_read(dist, read):
    """``read()`` on rank 0 first (it decodes and caches the data), then on the other ranks (which
    read the cache)."""
    if dist is not None and not dist.is_main:
        dist.barrier()
    result = read()
    if dist is not None and dist.is_main:
        dist.barrier()
    return result


def cache_dir_of(config: TrainConfig):
    return cache.default_cache_dir() if config.data.cache_dir == "default" else config.data.cache_dir


def _count(data) -> int | None:
    from ..data.tensors import rows

    if is_tensors(data):
        return rows(data)
    if is_batch_source(data):
        return getattr(data, "num_images", None)
    if isinstance(data, torch.utils.data.DataLoader):
        data = data.dataset
    return len(data) if hasattr(data, "__len__") else None


def _user_inputs(train_data, eval_data, config: TrainConfig) -> TrainingInputs:
    if eval_data is None:
        if isinstance(train_data, (torch.utils.data.DataLoader, torch.utils.data.IterableDataset)) or \
                is_batch_source(train_data):
            raise GpuaccelError(f"a {type(train_data).__name__} cannot be split for evaluation; pass eval_data=")
        train_data, eval_data = split_off(train_data, config.data.val_split or 0.1, config.loop.seed)
    kind = type(train_data).__name__
    train_n, test_n = _count(train_data), _count(eval_data)

    def build(config: TrainConfig, *, device, dtype, channels_last, rank, world_size):
        common = dict(device=device, placement=config.data.loader, workers=config.data.workers, seed=config.loop.seed,
                      rank=rank, world_size=world_size)
        if config.data.loader == "stream":
            raise GpuaccelError("--loader stream reads image folders; a Python data set is loaded with "
                                "--loader auto, gpu or cpu")
        return (user_loader(train_data, batch_size=config.loop.batch_size, train=True, **common),
                user_loader(eval_data, batch_size=config.loop.eval_batch_size, train=False, **common))

    return TrainingInputs(
        name=kind.lower(), description=f"{kind}: {train_n if train_n is not None else '?'} train / "
                                       f"{test_n if test_n is not None else '?'} eval samples",
        train_samples=train_n, test_samples=test_n,
        identity={"train_samples": train_n, "test_samples": test_n}, build=build)
