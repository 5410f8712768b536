"""What the trainer trains on: gpuaccel's readers (``config.data``), or a user's own data
(a torch Dataset, a DataLoader, or tensors), opened into one :class:`TrainingInputs`.

It knows what the model factory may be offered (image data: classes, channels, size),
what a checkpoint records to recognise the data on resume, which task the data implies
(image data: classification), and builds the two loaders once the model's layout and the
precision are known.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..data import ImageDataset, StreamingDataset, open_dataset
from ..data.augment import AugmentConfig
from ..data.loader import build_loader
from ..data.tensors import build_user_loader, is_tensors, split_off
from ..errors import GpuaccelError
from .config import TrainConfig

USER_DATA = "python"  # config.data of a run whose data came through the Python API


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
    build: Callable = None  # (config, device, dtype, channels_last, rank, world_size) -> (train, eval) loaders

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


def open_inputs(config: TrainConfig, *, dataset=None, train_data=None, eval_data=None, dist=None,
                device: torch.device) -> TrainingInputs:
    if train_data is not None:
        if dataset is not None:
            raise GpuaccelError("pass either dataset= (a gpuaccel image data set) or train_data=, not both")
        if isinstance(train_data, (ImageDataset, StreamingDataset)):
            dataset = train_data
        else:
            return _user_inputs(train_data, eval_data, config)
    elif eval_data is not None:
        raise GpuaccelError("eval_data= needs train_data=")
    if dataset is None:
        if config.data == USER_DATA:
            raise GpuaccelError("this run's data came through the Python API; pass the same train_data= "
                                "(and eval_data=) again")
        if dist is not None and not dist.is_main:
            dist.barrier()  # rank 0 decodes and caches the data set; the others then read the cache
        dataset = open_dataset(config.data, stream=config.loader == "stream", val_split=config.val_split,
                               image_size=config.image_size, skip_bad=config.skip_bad, seed=config.seed,
                               cache_dir=config.cache_dir, decode_device=device)
        if dist is not None and dist.is_main:
            dist.barrier()
    return _image_inputs(dataset)


def _image_inputs(ds: ImageDataset | StreamingDataset) -> TrainingInputs:
    mean, std = ds.channel_stats()
    streamed = isinstance(ds, StreamingDataset)
    shape = (ds.in_channels, ds.image_size, ds.image_size) if streamed else tuple(ds.train_images.shape[1:])
    identity = {"classes": list(ds.classes), "train_samples": len(ds.train_labels),
                "test_samples": len(ds.test_labels), "sample_shape": list(shape),
                "label_counts": np.bincount(ds.train_labels, minlength=ds.num_classes).tolist()}

    def build(config: TrainConfig, *, device, dtype, channels_last, rank, world_size):
        common = dict(device=device, mean=mean, std=std, dtype=dtype, channels_last=channels_last,
                      seed=config.seed, rank=rank, world_size=world_size)
        if streamed:
            if config.crop_padding or config.cutout:
                raise GpuaccelError("--crop-padding and --cutout are for in-memory data; streamed images are "
                                    "random-resized crops with random flips")
            common.update(skip_bad=config.skip_bad, workers=config.workers, cpu_decode=config.cpu_decode)
            return (ds.loader(train=True, batch_size=config.batch_size, **common),
                    ds.loader(train=False, batch_size=config.eval_batch_size, **common))
        common.update(placement=config.loader, workers=config.workers)
        train = build_loader(torch.from_numpy(ds.train_images), torch.from_numpy(ds.train_labels),
                             batch_size=config.batch_size, train=True,
                             augment=AugmentConfig(config.crop_padding, config.flip, config.cutout), **common)
        test = build_loader(torch.from_numpy(ds.test_images), torch.from_numpy(ds.test_labels),
                            batch_size=config.eval_batch_size, train=False, **common)
        return train, test

    return TrainingInputs(
        name=ds.name, description=ds.describe(), train_samples=len(ds.train_labels),
        test_samples=len(ds.test_labels),
        model_args={"num_classes": ds.num_classes, "in_channels": ds.in_channels, "image_size": ds.image_size},
        identity=identity, classes=list(ds.classes), mean=mean, std=std, images=ds,
        build=build)


def _count(data) -> int | None:
    from ..data.tensors import rows

    if is_tensors(data):
        return rows(data)
    if isinstance(data, torch.utils.data.DataLoader):
        data = data.dataset
    return len(data) if hasattr(data, "__len__") else None


def _user_inputs(train_data, eval_data, config: TrainConfig) -> TrainingInputs:
    if eval_data is None:
        if isinstance(train_data, (torch.utils.data.DataLoader, torch.utils.data.IterableDataset)):
            raise GpuaccelError("a DataLoader or IterableDataset cannot be split for evaluation; pass eval_data=")
        train_data, eval_data = split_off(train_data, config.val_split or 0.1, config.seed)
    kind = type(train_data).__name__
    train_n, test_n = _count(train_data), _count(eval_data)

    def build(config: TrainConfig, *, device, dtype, channels_last, rank, world_size):
        common = dict(device=device, placement=config.loader, workers=config.workers, seed=config.seed,
                      rank=rank, world_size=world_size)
        if config.loader == "stream":
            raise GpuaccelError("--loader stream reads image folders; a Python data set is loaded with "
                                "--loader auto, gpu or cpu")
        return (build_user_loader(train_data, batch_size=config.batch_size, train=True, **common),
                build_user_loader(eval_data, batch_size=config.eval_batch_size, train=False, **common))

    return TrainingInputs(
        name=kind.lower(), description=f"{kind}: {train_n if train_n is not None else '?'} train / "
                                       f"{test_n if test_n is not None else '?'} eval samples",
        train_samples=train_n, test_samples=test_n,
        identity={"train_samples": train_n, "test_samples": test_n}, build=build)
