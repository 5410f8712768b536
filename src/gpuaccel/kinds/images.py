"""Images with one class each: MNIST IDX files, CIFAR pickles, an image folder (or a .tar of
one), .npz arrays, a directory of .tar shards (streamed), or the built-in 8x8 digits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..data import ImageDataset, StreamingDataset, open_dataset
from ..data.augment import AugmentConfig, parse_size_schedule
from ..data.formats import READERS, detect_kind
from ..data.kinds import DataKind, register_kind
from ..data.stream import PILLOW_READERS, check_cpu_decode
from ..errors import GpuaccelError
from ..runtime.loaders import image_loader, stream_loader
from ..settings import setting

if TYPE_CHECKING:
    from ..train.inputs import TrainingInputs


@dataclass
class ImagesOptions:
    """The setting only images read: how a streamed batch's decoding is shared between the GPU and
    the reader processes."""
    cpu_decode: float | None = setting(
        None, "with --loader stream on a GPU: the share of each batch the reader processes decode with "
        f"Pillow, nvJPEG decoding the rest (default 1 with at least {PILLOW_READERS} reader processes, else 0; "
        "docs/data.md)", metavar="F")


class Images(DataKind):
    name = "images"
    settings = ("image_size", "loader", "workers", "skip_bad", "crop_padding", "flip", "cutout",
                "brightness", "contrast", "size_schedule")
    options = ImagesOptions
    formats = tuple(READERS)
    detect_order = 1000  # last: an image folder is what a folder is when nothing more specific is found
    description = "images with a class each (MNIST, CIFAR, an image folder or .tar of one, .npz, .tar shards)"
    default_model = "lenet5"
    default_task = "classification"
    streams = True  # --loader stream decodes image folders every step

    def validate_options(self, data) -> None:
        check_cpu_decode(data.cpu_decode)

    def detect(self, path: Path) -> str | None:
        return detect_kind(path)

    def open(self, config, path, fmt, *, dist=None) -> TrainingInputs:
        from ..train.inputs import shared_read  # (train/config.py imports the kinds)

        # Decoded once into the cache with Pillow (libjpeg), the reference decoder, also on a GPU machine:
        # nvJPEG's pixels differ (half of CIFAR-10's by 1-94 levels) and cost cifar10-fast 0.3% of
        # accuracy, and for small images its batches were slower than Pillow in 16 processes.
        # nvJPEG decodes where it pays: streamed batches (--loader stream).
        dataset = shared_read(dist, lambda: open_dataset(
            config.data.source, stream=config.data.loader == "stream", val_split=config.data.val_split,
            image_size=config.data.image_size,
            skip_bad=config.data.skip_bad, seed=config.loop.seed, cache_dir=config.data.cache_dir))
        return self.inputs_of(dataset)

    def inputs_of(self, ds: ImageDataset | StreamingDataset) -> TrainingInputs:
        """The trainer's inputs of an image data set a gpuaccel reader made."""
        from ..train.inputs import TrainingInputs  # (train/config.py imports the kinds)

        mean, std = ds.channel_stats()
        streamed = isinstance(ds, StreamingDataset)
        shape = (ds.in_channels, ds.image_size, ds.image_size) if streamed else tuple(ds.train_images.shape[1:])
        identity = {"classes": list(ds.classes), "train_samples": len(ds.train_labels),
                    "test_samples": len(ds.test_labels), "sample_shape": list(shape),
                    "label_counts": np.bincount(ds.train_labels, minlength=ds.num_classes).tolist()}

        def build(config, *, device, dtype, channels_last, rank, world_size):
            common = dict(device=device, mean=mean, std=std, dtype=dtype, channels_last=channels_last,
                          seed=config.loop.seed, rank=rank, world_size=world_size)
            if streamed:
                if config.data.crop_padding or config.data.cutout or config.data.brightness or config.data.contrast or \
                        config.data.size_schedule:
                    raise GpuaccelError("--crop-padding, --cutout, --brightness, --contrast and --size-schedule are "
                                        "for in-memory data; streamed images are random-resized crops with random "
                                        "flips")
                common.update(skip_bad=config.data.skip_bad, workers=config.data.workers,
                              cpu_decode=config.data.cpu_decode)
                return (stream_loader(ds, train=True, batch_size=config.loop.batch_size, **common),
                        stream_loader(ds, train=False, batch_size=config.loop.eval_batch_size, **common))
            common.update(placement=config.data.loader, workers=config.data.workers)
            train = image_loader(torch.from_numpy(ds.train_images), torch.from_numpy(ds.train_labels),
                                 batch_size=config.loop.batch_size, train=True, augment=_augment_of(config.data),
                                 **common)
            test = image_loader(torch.from_numpy(ds.test_images), torch.from_numpy(ds.test_labels),
                                batch_size=config.loop.eval_batch_size, train=False, **common)
            return train, test

        return TrainingInputs(
            name=ds.name, description=ds.describe(), train_samples=len(ds.train_labels),
            test_samples=len(ds.test_labels),
            model_args={"num_classes": ds.num_classes, "in_channels": ds.in_channels, "image_size": ds.image_size},
            identity=identity, classes=list(ds.classes), mean=mean, std=std, images=ds, task="classification",
            unit="images", build=build, data_kind=self.name,
            # data_init: a sample of normalised images, e.g. for patch whitening
            init_sample=lambda loader: (loader.sample(5000)[0],) if hasattr(loader, "sample") else None)

    def owned_before_kinds(self, state: dict) -> bool:
        return state.get("mean") is not None and (state.get("task") or {}).get("name") not in ("detection",
                                                                                              "segmentation")

    def export(self, run, fmt, out, *, data, verify_count, static_batch, opset):
        from ..deploy.exports import export_image_classifier

        return export_image_classifier(run, fmt, out, data=data, verify_count=verify_count,
                                       static_batch=static_batch, opset=opset), "images"

    def held_out(self, run, data, why):
        from ..deploy.artifact import load_trained
        from ..deploy.heldout import HeldOut
        from ..deploy.infer import images_for_model

        trained = load_trained(run)
        d = trained.load_data(data, why)
        return HeldOut("images", d.train_images, d.test_images, d.test_labels, images_for_model, trained.source)


def _augment_of(data) -> AugmentConfig:
    """The training images' augmentation (and progressive resizing) that the data section asks for."""
    return AugmentConfig(data.crop_padding, data.flip, data.cutout, data.brightness, data.contrast,
                         parse_size_schedule(data.size_schedule))


register_kind(Images())
