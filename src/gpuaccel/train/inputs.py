"""What the trainer trains on: gpuaccel's readers (``config.data``), or a user's own data
(a torch Dataset, a DataLoader, or tensors), opened into one :class:`TrainingInputs`.

It knows what the model factory may be offered (image data: classes, channels, size; text:
the vocabulary and context length), what a checkpoint records to recognise the data on
resume, which task the data implies (image data: classification; text: language
modelling), and builds the two loaders once the model's layout and the
precision are known.
"""

from __future__ import annotations

import hashlib
import json

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..data import AUDIO_KIND, NON_IMAGE_KINDS, RATINGS_KIND, ImageDataset, StreamingDataset, cache, open_dataset, parse_spec
from ..data.audio import AudioDataset, load_audio
from ..data.ratings import Interactions, NegativeSamplingLoader, Ratings, load_interactions, load_ratings
from ..data.scene_loader import SceneAugment, SceneLoader
from ..data.scenes import SCENE_KINDS, SceneDataset, load_scenes, scene_kind
from ..data.augment import AugmentConfig, parse_size_schedule
from ..data.loader import build_loader
from ..data.tensors import is_tensors, split_off
from ..data.sentences import LabelledText, SentenceLoader, load_sentences
from ..data.text import TextCorpus, WindowLoader, load_corpus, validation_windows
from ..errors import GpuaccelError
from ..runtime.loaders import ResidentLoader, user_loader
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
    if dataset is None:
        if config.data == USER_DATA:
            raise GpuaccelError("this run's data came through the Python API; pass the same train_data= "
                                "(and eval_data=) again")
        kind, path = parse_spec(config.data)
        if kind in (*NON_IMAGE_KINDS, *SCENE_KINDS) and config.loader == "stream":
            raise GpuaccelError(f"--loader stream reads image folders; {kind} data is read once and kept on the "
                                f"device (use --loader auto, gpu or cpu)")
        if kind == "text":
            return _corpus_inputs(_shared_read(dist, lambda: load_corpus(
                path, tokenizer=config.tokenizer or "char", vocab_size=config.vocab_size or 2048,
                val_split=config.val_split, cache_dir=_cache_dir(config))), config)
        if kind == "sentences":
            return _sentence_inputs(_shared_read(dist, lambda: load_sentences(
                path, tokenizer=config.tokenizer or "word", vocab_size=config.vocab_size, max_tokens=config.context,
                val_split=config.val_split, seed=config.seed, text_column=config.text_column,
                label_column=config.label_column, cache_dir=_cache_dir(config))), config)
        if kind == AUDIO_KIND:
            return _audio_inputs(_shared_read(dist, lambda: load_audio(
                path, label_pattern=config.label_pattern, test_where=config.test_where, sample_rate=config.sample_rate,
                clip_seconds=config.clip_seconds, val_split=config.val_split, skip_bad=config.skip_bad,
                seed=config.seed, cache_dir=_cache_dir(config))), config)
        if kind == RATINGS_KIND and config.task == "ranking":
            return _interaction_inputs(_shared_read(dist, lambda: load_interactions(
                path, negatives=config.eval_negatives, seed=config.seed, cache_dir=_cache_dir(config))), config)
        if kind == RATINGS_KIND:
            return _ratings_inputs(_shared_read(dist, lambda: load_ratings(
                path, val_split=config.val_split, seed=config.seed, cache_dir=_cache_dir(config))), config)
        if kind in SCENE_KINDS:
            if not config.data.lower().startswith(f"{kind}:"):  # (found, not named: the task may choose)
                kind = scene_kind(path, config.task)
            return _scene_inputs(_shared_read(dist, lambda: load_scenes(
                path, kind, image_size=config.image_size, skip_bad=config.skip_bad, val_split=config.val_split,
                seed=config.seed, cache_dir=_cache_dir(config))), config)
        # Decoded once into the cache with Pillow (libjpeg), the reference decoder, also on a GPU machine:
        # nvJPEG's pixels differ (half of CIFAR-10's by 1-94 levels) and cost cifar10-fast 0.3% of
        # accuracy, and for small images its batches were slower than Pillow in 16 processes
        # (docs/results.md). nvJPEG decodes where it pays: streamed batches (--loader stream).
        dataset = _shared_read(dist, lambda: open_dataset(
            config.data, stream=config.loader == "stream", val_split=config.val_split, image_size=config.image_size,
            skip_bad=config.skip_bad, seed=config.seed, cache_dir=config.cache_dir))
    return _image_inputs(dataset)


def _shared_read(dist, read):
    """``read()`` on rank 0 first (it decodes and caches the data), then on the other ranks (which
    read the cache)."""
    if dist is not None and not dist.is_main:
        dist.barrier()
    result = read()
    if dist is not None and dist.is_main:
        dist.barrier()
    return result


def _cache_dir(config: TrainConfig):
    return cache.default_cache_dir() if config.cache_dir == "default" else config.cache_dir


def _corpus_inputs(corpus: TextCorpus, config: TrainConfig) -> TrainingInputs:
    corpus.check_context(config.context)
    identity = {"tokenizer": corpus.tokenizer.kind, "vocab_size": corpus.vocab_size, "context": config.context,
                "train_tokens": len(corpus.train), "val_tokens": len(corpus.val), "files": corpus.fingerprint}

    def build(config: TrainConfig, *, device, dtype, channels_last, rank, world_size):
        train = WindowLoader(torch.from_numpy(corpus.train), context=config.context, batch_size=config.batch_size,
                             device=device, seed=config.seed, rank=rank, world_size=world_size)
        val = ResidentLoader(validation_windows(corpus.val, config.context), batch_size=config.eval_batch_size,
                           device=device, train=False, rank=rank, world_size=world_size)
        return train, val

    train_windows = (len(corpus.train) - 1) // config.context
    return TrainingInputs(
        name=corpus.name, description=corpus.describe(), train_samples=train_windows,
        test_samples=(len(corpus.val) - 1) // config.context,
        model_args={"vocab_size": corpus.vocab_size, "context_length": config.context}, identity=identity,
        task="language_modelling", tokenizer=corpus.tokenizer.state(), unit="windows", default_model="gpt",
        tokens_per_sample=config.context, build=build)


def _sentence_inputs(data: LabelledText, config: TrainConfig) -> TrainingInputs:
    identity = {"classes": data.classes, "tokenizer": data.tokenizer.kind, "vocab_size": data.tokenizer.vocab_size,
                "train_samples": len(data.train_labels), "test_samples": len(data.test_labels),
                "label_counts": np.bincount(data.train_labels, minlength=data.num_classes).tolist(),
                "files": data.fingerprint}

    def build(config: TrainConfig, *, device, dtype, channels_last, rank, world_size):
        common = dict(device=device, seed=config.seed, rank=rank, world_size=world_size)
        return (SentenceLoader(data.train_ids, data.train_lengths, data.train_labels, batch_size=config.batch_size,
                               train=True, **common),
                SentenceLoader(data.test_ids, data.test_lengths, data.test_labels,
                               batch_size=config.eval_batch_size, train=False, **common))

    return TrainingInputs(
        name=data.name, description=data.describe(), train_samples=len(data.train_labels),
        test_samples=len(data.test_labels),
        model_args={"vocab_size": data.tokenizer.vocab_size, "num_classes": data.num_classes,
                    "context_length": data.train_ids.shape[1]},
        identity=identity, classes=data.classes, task="classification", tokenizer=data.tokenizer.state(),
        unit="sentences", default_model="text_transformer", build=build)


def _audio_inputs(data: AudioDataset, config: TrainConfig) -> TrainingInputs:
    if config.tta:
        raise GpuaccelError("--tta flips and shifts images; for recordings leave it at 0 (the model's time shift "
                            "augments in training)")
    identity = {"classes": data.classes, "train_samples": len(data.train_labels),
                "test_samples": len(data.test_labels), "sample_rate": data.sample_rate,
                "clip_samples": data.clip_samples,
                "label_counts": np.bincount(data.train_labels, minlength=data.num_classes).tolist(),
                "files": data.fingerprint}

    def build(config: TrainConfig, *, device, dtype, channels_last, rank, world_size):
        common = dict(device=device, seed=config.seed, rank=rank, world_size=world_size)
        return (ResidentLoader((torch.from_numpy(data.train_waves), torch.from_numpy(data.train_labels)),
                             batch_size=config.batch_size, train=True, **common),
                ResidentLoader((torch.from_numpy(data.test_waves), torch.from_numpy(data.test_labels)),
                             batch_size=config.eval_batch_size, train=False, **common))

    return TrainingInputs(
        name=data.name, description=data.describe(), train_samples=len(data.train_labels),
        test_samples=len(data.test_labels),
        model_args={"num_classes": data.num_classes, "sample_rate": data.sample_rate}, identity=identity,
        classes=data.classes, task="classification", unit="recordings", default_model="audio_tcnn",
        audio={"sample_rate": data.sample_rate, "clip_samples": data.clip_samples}, build=build)


def _ratings_inputs(data: Ratings, config: TrainConfig) -> TrainingInputs:
    identity = {"train_samples": len(data.train_ratings), "test_samples": len(data.test_ratings),
                "users": data.num_users, "items": data.num_items, "files": data.fingerprint}

    def build(config: TrainConfig, *, device, dtype, channels_last, rank, world_size):
        common = dict(device=device, seed=config.seed, rank=rank, world_size=world_size)
        return tuple(ResidentLoader(tuple(torch.from_numpy(getattr(data, f"{split}_{part}"))
                                        for part in ("users", "items", "ratings")),
                                  batch_size=size, train=split == "train", **common)
                     for split, size in (("train", config.batch_size), ("test", config.eval_batch_size)))

    return TrainingInputs(
        name=data.name, description=data.describe(), train_samples=len(data.train_ratings),
        test_samples=len(data.test_ratings),
        model_args={"num_users": data.num_users, "num_items": data.num_items,
                    "rating_mean": round(float(data.train_ratings.mean()), 6), "rating_range": list(data.rating_range),
                    # (a model that takes them, e.g. neural_mf; an empty side is None)
                    **{f"{side}_features": data.side_features.get(side) or None for side in ("user", "item")}},
        identity=identity, task="regression", unit="ratings", default_model="matrix_factorization",
        ratings={"user_ids": data.user_ids, "item_ids": data.item_ids}, build=build,
        init_sample=lambda loader: loader.tensors)  # every training rating: (users, items, ratings)


def _interaction_inputs(data: Interactions, config: TrainConfig) -> TrainingInputs:
    identity = {"train_samples": len(data.train_users), "test_samples": len(data.test_users),
                "users": data.num_users, "items": data.num_items, "eval_negatives": config.eval_negatives,
                "files": data.fingerprint}

    def build(config: TrainConfig, *, device, dtype, channels_last, rank, world_size):
        common = dict(device=device, seed=config.seed, rank=rank, world_size=world_size)
        train = NegativeSamplingLoader(data.train_users, data.train_items, data.num_items, negatives=config.negatives,
                                       batch_size=config.batch_size, **common)
        test = ResidentLoader((torch.from_numpy(data.test_users), torch.from_numpy(data.test_items),
                             torch.zeros(len(data.test_users), dtype=torch.long)),  # the held-out item: column 0
                            batch_size=config.eval_batch_size, train=False, **common)
        return train, test

    return TrainingInputs(
        name=data.name, description=data.describe(), train_samples=len(data.train_users) * (1 + config.negatives),
        test_samples=len(data.test_users),
        model_args={"num_users": data.num_users, "num_items": data.num_items, "rating_mean": 0.0, "rating_range": None},
        identity=identity, task="ranking", unit="pairs", default_model="matrix_factorization",
        ratings={"user_ids": data.user_ids, "item_ids": data.item_ids}, build=build)


def _scene_inputs(data: SceneDataset, config: TrainConfig) -> TrainingInputs:
    if config.crop_padding or config.cutout or config.size_schedule:
        raise GpuaccelError("--crop-padding, --cutout and --size-schedule are for image classification; "
                            "detection and segmentation augment with --flip, --zoom, --brightness and --contrast, "
                            "which move the boxes and masks with the pixels")
    if config.tta and data.kind == "detection":
        raise GpuaccelError("--tta averages class scores or masks over mirrored images; detection takes 0 (boxes "
                            "from two images would need merging)")
    mean, std = data.channel_stats()
    detection = data.kind == "detection"
    classes = list(data.classes) if detection else ["background", *data.classes]  # (mask value = class index)
    identity = {"classes": classes, "train_samples": len(data.train), "test_samples": len(data.test),
                "sample_shape": list(data.train.images.shape[1:]), "files": data.fingerprint}
    augment = SceneAugment(flip=config.flip != "none", zoom=config.zoom, brightness=config.brightness,
                           contrast=config.contrast)

    def build(config: TrainConfig, *, device, dtype, channels_last, rank, world_size):
        common = dict(device=device, mean=mean, std=std, dtype=dtype, channels_last=channels_last, seed=config.seed,
                      rank=rank, world_size=world_size)
        return (SceneLoader(data.train, batch_size=config.batch_size, train=True, augment=augment, **common),
                SceneLoader(data.test, batch_size=config.eval_batch_size, train=False, **common))

    return TrainingInputs(
        name=data.name, description=data.describe(), train_samples=len(data.train), test_samples=len(data.test),
        model_args={"num_classes": len(classes), "in_channels": data.in_channels, "image_size": data.image_size},
        identity=identity, classes=classes, mean=mean, std=std, task=data.kind, unit="images", build=build,
        default_model="centernet" if detection else "unet")


def augment_config(config: TrainConfig) -> AugmentConfig:
    """The training images' augmentation (and progressive resizing) that ``config`` asks for."""
    return AugmentConfig(config.crop_padding, config.flip, config.cutout, config.brightness, config.contrast,
                         parse_size_schedule(config.size_schedule))


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
            if config.crop_padding or config.cutout or config.brightness or config.contrast or config.size_schedule:
                raise GpuaccelError("--crop-padding, --cutout, --brightness, --contrast and --size-schedule are for "
                                    "in-memory data; streamed images are random-resized crops with random flips")
            common.update(skip_bad=config.skip_bad, workers=config.workers, cpu_decode=config.cpu_decode)
            return (ds.loader(train=True, batch_size=config.batch_size, **common),
                    ds.loader(train=False, batch_size=config.eval_batch_size, **common))
        common.update(placement=config.loader, workers=config.workers)
        train = build_loader(torch.from_numpy(ds.train_images), torch.from_numpy(ds.train_labels),
                             batch_size=config.batch_size, train=True,
                             augment=augment_config(config), **common)
        test = build_loader(torch.from_numpy(ds.test_images), torch.from_numpy(ds.test_labels),
                            batch_size=config.eval_batch_size, train=False, **common)
        return train, test

    return TrainingInputs(
        name=ds.name, description=ds.describe(), train_samples=len(ds.train_labels),
        test_samples=len(ds.test_labels),
        model_args={"num_classes": ds.num_classes, "in_channels": ds.in_channels, "image_size": ds.image_size},
        identity=identity, classes=list(ds.classes), mean=mean, std=std, images=ds, task="classification",
        unit="images", build=build,  # data_init: a sample of normalised images, e.g. for patch whitening
        init_sample=lambda loader: (loader.normalised_sample(5000),) if hasattr(loader, "normalised_sample") else None)


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
        return (user_loader(train_data, batch_size=config.batch_size, train=True, **common),
                user_loader(eval_data, batch_size=config.eval_batch_size, train=False, **common))

    return TrainingInputs(
        name=kind.lower(), description=f"{kind}: {train_n if train_n is not None else '?'} train / "
                                       f"{test_n if test_n is not None else '?'} eval samples",
        train_samples=train_n, test_samples=test_n,
        identity={"train_samples": train_n, "test_samples": test_n}, build=build)
