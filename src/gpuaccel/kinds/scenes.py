"""Detection and segmentation scenes: COCO annotations, YOLO labels or class masks beside their
images (data/scenes.py reads them); batches augmented on the device with their boxes and masks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..data.kinds import DataKind, register_kind
from ..data.scene_loader import SceneAugment, SceneBatches, scene_tensors
from ..data.scenes import SCENE_KINDS, load_scenes, scene_kind
from ..errors import GpuaccelError
from ..runtime.loaders import ResidentLoader
from ..settings import setting

if TYPE_CHECKING:
    from ..train.inputs import TrainingInputs


@dataclass
class ScenesOptions:
    """The setting only detection and segmentation scenes read: random zoom, boxes and masks with it."""
    zoom: float = setting(0.0, "detection and segmentation: scale each training image by a random factor in "
                               "[1 - Z, 1 + Z] at a random place, boxes and masks with it", metavar="Z")


class Scenes(DataKind):
    name = "scenes"
    settings = ("image_size", "skip_bad", "crop_padding", "flip", "cutout", "brightness", "contrast",
                "size_schedule")
    options = ScenesOptions
    formats = SCENE_KINDS
    detect_order = 50
    description = "detection (COCO annotations, YOLO labels) or segmentation (masks) folders beside images/"
    default_model = "centernet (detection), unet (segmentation)"
    default_task = "detection or segmentation"

    def validate_options(self, data) -> None:
        if not 0 <= data.zoom < 1:
            raise GpuaccelError(f"--zoom must be in [0, 1), got {data.zoom}")

    def detect(self, path: Path) -> str | None:
        return scene_kind(path)

    def open(self, config, path, fmt, *, dist=None) -> TrainingInputs:
        from ..train.inputs import TrainingInputs, cache_dir_of, shared_read  # (train/config.py imports the kinds)
        # (found, not named: the task chooses)
        if fmt == self.name or not config.data.source.lower().startswith(f"{fmt}:"):
            fmt = scene_kind(path, config.model.task) or fmt
        if fmt == self.name:
            raise GpuaccelError(f"{path} holds no COCO annotations, YOLO labels or masks beside images/")
        if config.data.crop_padding or config.data.cutout or config.data.size_schedule:
            raise GpuaccelError("--crop-padding, --cutout and --size-schedule are for image classification; "
                                "detection and segmentation augment with --flip, --zoom, --brightness and --contrast, "
                                "which move the boxes and masks with the pixels")
        data = shared_read(dist, lambda: load_scenes(
            path, fmt, image_size=config.data.image_size, skip_bad=config.data.skip_bad,
            val_split=config.data.val_split,
            seed=config.loop.seed, cache_dir=cache_dir_of(config)))
        if config.loop.tta and data.kind == "detection":
            raise GpuaccelError("--tta averages class scores or masks over mirrored images; detection takes 0 (boxes "
                                "from two images would need merging)")
        mean, std = data.channel_stats()
        detection = data.kind == "detection"
        classes = list(data.classes) if detection else ["background", *data.classes]  # (mask value = class index)
        identity = {"classes": classes, "train_samples": len(data.train), "test_samples": len(data.test),
                    "sample_shape": list(data.train.images.shape[1:]), "files": data.fingerprint}
        augment = SceneAugment(flip=config.data.flip != "none", zoom=config.data.zoom,
                               brightness=config.data.brightness,
                               contrast=config.data.contrast)

        def build(config, *, device, dtype, channels_last, rank, world_size):
            def loader(split, batch_size, train):
                batches = SceneBatches(mean=mean, std=std, device=device, dtype=dtype, channels_last=channels_last,
                                       augment=augment if train else None)
                return ResidentLoader(scene_tensors(split, device), batch_size=batch_size, device=device, train=train,
                                      seed=config.loop.seed, rank=rank, world_size=world_size, transform=batches)
            return (loader(data.train, config.loop.batch_size, True),
                    loader(data.test, config.loop.eval_batch_size, False))

        return TrainingInputs(
            name=data.name, description=data.describe(), train_samples=len(data.train), test_samples=len(data.test),
            model_args={"num_classes": len(classes), "in_channels": data.in_channels, "image_size": data.image_size},
            identity=identity, classes=classes, mean=mean, std=std, task=data.kind, unit="images", build=build,
            default_model="centernet" if detection else "unet", data_kind=self.name)

    def owned_before_kinds(self, state: dict) -> bool:
        return (state.get("task") or {}).get("name") in ("detection", "segmentation")

    def export(self, run, fmt, out, *, data, verify_count, static_batch, opset):
        from ..deploy.vision import export_scene_model

        return export_scene_model(run, fmt, out, data=data, verify_count=verify_count, static_batch=static_batch,
                                  opset=opset)

    def held_out(self, run, data, why):
        from ..deploy.artifact import load_run_state

        task = (load_run_state(run)[0].get("task") or {}).get("name", "detection or segmentation")
        raise GpuaccelError(f"{run} is a {task} model: 'gpuaccel export' and 'gpuaccel infer' take it; quantize, "
                            f"prune and bench-infer work on classifiers")


register_kind(Scenes())
