"""Readers for object detection and semantic segmentation data, in the layouts users bring.

- ``coco``: ``annotations/instances_<split>.json`` (COCO detection: ``images``, ``annotations``
  with ``bbox`` [x, y, w, h] in pixels, ``categories``) beside the images, found under the
  folder, ``images/`` or ``images/<split>/``;
- ``yolo``: ``images/[<split>/]*.jpg`` and ``labels/[<split>/]*.txt`` (one ``class cx cy w h``
  line per object, normalised to the image); class names from ``classes.txt`` or ``data.yaml``;
- ``masks``: ``images/[<split>/]*.jpg`` and ``masks/[<split>/]*.png`` of the same names (each
  pixel its class: 0 background, 1..K the classes, 255 not scored); class names from
  ``classes.txt`` (K lines, or K + 1 with the background first), ``data.yaml``, or the COCO
  categories beside them (category id = mask value).

Each reads into a :class:`SceneDataset`: uint8 images (N, C, H, W) of one size (``--image-size``,
else the most common one; boxes and masks scaled with them), boxes as (N, M, 4) float32 x0, y0,
x1, y1 pixels with (N, M) int64 labels, -1 padding the images with fewer than M objects (so a
batch is a gather, whatever the object counts), and masks as (N, H, W) uint8. Decoded once into
the decoded-data cache. A split named train and one named val/valid/test are the training and
held-out data; with no held-out split, ``--val-split`` of the images are held out.
"""

from __future__ import annotations

import json
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import GpuaccelError
from . import cache
from .images import ImageSource, decode_images, is_image_name

SCENE_KINDS = ("coco", "yolo", "masks")
HELD_OUT_NAMES = ("val", "valid", "validation", "test")
IGNORE = 255  # a mask value that is not scored (the usual convention, e.g. Pascal VOC's borders)
BOX_TOLERANCE = 1.0  # pixels a box may stick out of its image (rounding in the tools that wrote it)


@dataclass
class SceneSplit:
    images: np.ndarray  # (N, C, H, W) uint8
    boxes: np.ndarray | None = None  # (N, M, 4) float32 x0 y0 x1 y1 in pixels; rows past an image's objects are 0
    labels: np.ndarray | None = None  # (N, M) int64, -1 past an image's objects
    masks: np.ndarray | None = None  # (N, H, W) uint8
    names: list[str] = field(default_factory=list)  # each image's file, relative to the data folder

    def __len__(self) -> int:
        return len(self.images)

    @property
    def objects(self) -> int:
        return int((self.labels >= 0).sum()) if self.labels is not None else 0


@dataclass
class SceneDataset:
    """A decoded detection (``boxes``/``labels``) or segmentation (``masks``) data set."""

    name: str
    kind: str  # "detection" or "segmentation"
    train: SceneSplit
    test: SceneSplit
    classes: list[str]  # the object classes (segmentation: without the background)
    source: str = ""
    skipped: list[str] = field(default_factory=list)  # images (and boxes) left out, with why
    fingerprint: str = ""

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def in_channels(self) -> int:
        return int(self.train.images.shape[1])

    @property
    def image_shape(self) -> tuple[int, int]:
        return tuple(int(s) for s in self.train.images.shape[2:])

    @property
    def image_size(self) -> int:
        return max(self.image_shape)

    def channel_stats(self) -> tuple[list[float], list[float]]:
        from .dataset import ImageDataset

        return ImageDataset.channel_stats(self)  # (reads only train_images)

    @property
    def train_images(self) -> np.ndarray:
        return self.train.images

    def describe(self) -> str:
        c, h, w = self.train.images.shape[1:]
        what = (f", {self.train.objects} / {self.test.objects} objects" if self.kind == "detection" else "")
        skipped = f", {len(self.skipped)} skipped" if self.skipped else ""
        return (f"{self.name}: {self.kind}, {len(self.train)} train / {len(self.test)} test images, {c}x{h}x{w}, "
                f"{self.num_classes} classes{what}{skipped}")


# --- finding the layout ---------------------------------------------------------------------------

def scene_kind(path: Path, task: str | None = None) -> str | None:
    """Which scene layout ``path`` holds (None: none of them). A folder with COCO annotations,
    YOLO labels and masks (as digit scenes have) is read as masks when the task is
    segmentation, else as detection (COCO before YOLO)."""
    if not path.is_dir():
        return None
    has_masks = (path / "masks").is_dir() and (path / "images").is_dir()
    if task == "segmentation" and has_masks:
        return "masks"
    if _coco_files(path):
        return "coco"
    if (path / "labels").is_dir() and (path / "images").is_dir():
        return "yolo"
    return "masks" if has_masks else None


def _coco_files(root: Path) -> dict[str, Path]:
    """{split name: instances_<split>.json} under ``root/annotations``."""
    folder = root / "annotations"
    if not folder.is_dir():
        return {}
    return {p.stem[len("instances_"):]: p for p in sorted(folder.glob("instances_*.json"))}


def _splits(names) -> tuple[str | None, str | None]:
    """(training split, held-out split) among ``names`` (e.g. train2017, val2017)."""
    train = next((n for n in names if n.lower().startswith("train")), None)
    held = next((n for n in names for h in HELD_OUT_NAMES if n.lower().startswith(h)), None)
    return train, held


def _image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and is_image_name(p.name))


def _split_folders(root: Path, sub: str) -> dict[str | None, Path]:
    """``root/sub/<split>/`` folders by split name, or {None: root/sub} where it has no splits."""
    base = root / sub
    folders = {p.name: p for p in sorted(base.iterdir()) if p.is_dir()} if base.is_dir() else {}
    train, held = _splits(folders)
    if train is None:
        return {None: base}
    return {"train": folders[train], **({"val": folders[held]} if held else {})}


def class_names(root: Path, count_hint: int | None = None) -> list[str] | None:
    """Class names from ``classes.txt`` (one per line) or ``data.yaml``'s ``names`` (a list, or
    {id: name}); None where neither is there."""
    text_file = root / "classes.txt"
    if text_file.is_file():
        return [line.strip() for line in text_file.read_text().splitlines() if line.strip()]
    for yaml_file in (root / "data.yaml", root / "dataset.yaml"):
        if yaml_file.is_file():
            import yaml

            try:
                names = (yaml.safe_load(yaml_file.read_text()) or {}).get("names")
            except yaml.YAMLError as exc:
                raise GpuaccelError(f"cannot read {yaml_file}: {exc}".splitlines()[0]) from None
            if isinstance(names, dict):
                return [str(names[k]) for k in sorted(names, key=int)]
            if isinstance(names, list):
                return [str(n) for n in names]
    return None


# --- decoding, shared -----------------------------------------------------------------------------

@dataclass
class _Annotated:
    """What a reader found for one image before decoding: its file and its objects, boxes
    normalised to the image (0..1)."""

    path: Path
    boxes: list = field(default_factory=list)  # [x0, y0, x1, y1] normalised
    labels: list = field(default_factory=list)
    mask: Path | None = None
    size: tuple = (None, None)  # (width, height) where the annotations say


def _decode(items: list[_Annotated], root: Path, image_size: int | None, skip_bad: bool, skipped: list,
            with_masks: bool) -> SceneSplit:
    decoded, kept, bad = decode_images([ImageSource(str(i.path.relative_to(root)), path=str(i.path)) for i in items],
                                       image_size=image_size, skip_bad=skip_bad)
    skipped.extend(f"{name} (cannot be decoded)" for name in bad)
    items = [items[k] for k in kept]
    h, w = decoded.shape[2:]
    names = [str(i.path.relative_to(root)) for i in items]
    if with_masks:
        masks, keep = _read_masks(items, (h, w), image_size is not None, skip_bad, skipped, root)
        return SceneSplit(decoded[keep], masks=masks, names=[n for n, k in zip(names, keep) if k])
    most = max([len(i.labels) for i in items] + [1])
    boxes = np.zeros((len(items), most, 4), np.float32)
    labels = np.full((len(items), most), -1, np.int64)
    scale = np.array([w, h, w, h], np.float32)
    for n, item in enumerate(items):
        if item.labels:
            boxes[n, :len(item.labels)] = np.asarray(item.boxes, np.float32) * scale
            labels[n, :len(item.labels)] = item.labels
    return SceneSplit(decoded, boxes, labels, names=names)


def _read_masks(items: list[_Annotated], hw: tuple[int, int], resized: bool, skip_bad: bool, skipped: list,
                root: Path):
    """The masks of ``items`` as (N, H, W) uint8 at the images' size, and which items kept one."""
    from PIL import Image

    masks, keep = [], []
    for item in items:
        problem = None
        try:
            with Image.open(item.mask) as img:
                img.load()
                if img.mode not in ("L", "P", "I", "I;16", "1"):
                    problem = f"a mask is one class per pixel (a grey or palette PNG), not {img.mode}"
                else:
                    mask = np.asarray(img.convert("L") if img.mode in ("1",) else img)
                    if mask.size and int(mask.max()) > 255:  # (a 16-bit mask: uint8 would wrap it)
                        raise ValueError(f"it holds class value {int(mask.max())}; masks hold one class per "
                                         f"pixel, 0 (background) to 255")
                    with Image.open(item.path) as photo:
                        photo_size = photo.size
                    if mask.shape[::-1] != tuple(photo_size):
                        problem = f"it is {mask.shape[1]}x{mask.shape[0]}, its image {photo_size[0]}x{photo_size[1]}"
                    elif mask.shape != hw:
                        mask = np.asarray(Image.fromarray(mask.astype(np.uint8)).resize((hw[1], hw[0]),
                                                                                         Image.Resampling.NEAREST))
        except OSError as exc:
            problem = f"cannot be read ({type(exc).__name__}: {exc})"
        except ValueError as exc:
            problem = str(exc) if str(exc).startswith("it holds") else f"cannot be read (ValueError: {exc})"
        if problem is not None:
            name = item.mask.relative_to(root)
            if not skip_bad:
                raise GpuaccelError(f"mask {name}: {problem}; fix or remove it, or pass --skip-bad to skip the image")
            skipped.append(f"{name} ({problem})")
            keep.append(False)
            continue
        masks.append(mask.astype(np.uint8))
        keep.append(True)
    if not masks:
        raise GpuaccelError("no image has a usable mask")
    return np.stack(masks), np.asarray(keep)


def _bad_box(problem: str, where: str, skip_bad: bool, skipped: list) -> None:
    if not skip_bad:
        raise GpuaccelError(f"{where}: {problem}; fix the label, or pass --skip-bad to leave such boxes out")
    skipped.append(f"{where} ({problem})")


def _checked_box(x0, y0, x1, y1, width, height, where, skip_bad, skipped, slack: float | None = None) -> list | None:
    """The box normalised to its image, or None (skipped) where it has no area or lies outside (by
    more than BOX_TOLERANCE pixels, or ``slack`` of a side for normalised coordinates)."""
    if not (x1 - x0 > 0 and y1 - y0 > 0):
        _bad_box(f"box {[round(v, 2) for v in (x0, y0, x1, y1)]} has no area", where, skip_bad, skipped)
        return None
    tol_x, tol_y = (slack, slack) if slack is not None else (BOX_TOLERANCE / width, BOX_TOLERANCE / height)
    if x0 / width < -tol_x or y0 / height < -tol_y or x1 / width > 1 + tol_x or y1 / height > 1 + tol_y:
        _bad_box(f"box {[round(v, 2) for v in (x0, y0, x1, y1)]} lies outside the {width:g}x{height:g} image",
                 where, skip_bad, skipped)
        return None
    return [min(max(x0 / width, 0.0), 1.0), min(max(y0 / height, 0.0), 1.0),
            min(max(x1 / width, 0.0), 1.0), min(max(y1 / height, 0.0), 1.0)]


# --- COCO -------------------------------------------------------------------------------------------

def _coco_split(json_path: Path, root: Path, split: str, skip_bad: bool, skipped: list):
    """(items, {category id: name}) of one COCO annotation file."""
    try:
        data = json.loads(json_path.read_text())
        images, annotations, categories = data["images"], data.get("annotations", []), data["categories"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GpuaccelError(f"{json_path} is not COCO detection JSON ({type(exc).__name__}: {exc})") from None
    bases = [root / "images" / split, root / "images", root / split, root]
    by_id, order, listed, names_seen = {}, [], set(), {}
    for image in images:
        name = image["file_name"]
        if image["id"] in listed or name in names_seen:
            twice = f"image id {image['id']}" if image["id"] in listed else f"{name} (ids {names_seen[name]} and " \
                                                                            f"{image['id']})"
            raise GpuaccelError(f"{json_path.name} lists {twice} twice; an image is listed once, its boxes are "
                                f"annotations that name its id")
        listed.add(image["id"])
        names_seen[name] = image["id"]
        path = next((b / name for b in bases if (b / name).is_file()), None)
        if path is None:
            where = f"image {name} of {json_path.name}"
            if not skip_bad:
                raise GpuaccelError(f"{where} is missing (looked in {', '.join(str(b) for b in bases[:2])}); "
                                    f"pass --skip-bad to leave it out")
            skipped.append(f"{name} (missing)")
            continue
        by_id[image["id"]] = item = _Annotated(path)
        item.size = (image.get("width"), image.get("height"))
        order.append(item)
    names = {c["id"]: str(c.get("name", c["id"])) for c in categories}
    for ann in annotations:
        if ann.get("image_id") not in listed:
            _bad_box(f"annotation {ann.get('id')} is of image id {ann.get('image_id')}, which the file does not list",
                     json_path.name, skip_bad, skipped)
            continue
        item = by_id.get(ann.get("image_id"))
        if item is None or ann.get("iscrowd", 0):
            continue  # (an image left out; crowd regions are not objects to find)
        if ann.get("category_id") not in names:
            raise GpuaccelError(f"{json_path.name}: annotation {ann.get('id')} has category {ann.get('category_id')}, "
                                f"which is not among its categories")
        width, height = item.size
        if not width or not height:
            from PIL import Image

            with Image.open(item.path) as img:
                width, height = item.size = img.size
        x, y, w, h = (float(v) for v in ann["bbox"])
        box = _checked_box(x, y, x + w, y + h, width, height, f"{json_path.name} annotation {ann.get('id')}",
                           skip_bad, skipped)
        if box is not None:
            item.boxes.append(box)
            item.labels.append(ann["category_id"])
    return order, names


def read_coco(root: Path, opts) -> SceneDataset:
    files = _coco_files(root)
    train_name, held_name = _splits(files)
    if train_name is None:
        raise GpuaccelError(f"{root}/annotations has no instances_train*.json (found: "
                            f"{', '.join(p.name for p in files.values()) or 'none'})")
    skipped: list[str] = []
    train, names = _coco_split(files[train_name], root, train_name, opts.skip_bad, skipped)
    held = None
    if held_name is not None:
        held, held_names = _coco_split(files[held_name], root, held_name, opts.skip_bad, skipped)
        if held_names != names:
            raise GpuaccelError(f"{files[held_name].name} and {files[train_name].name} have different categories")
    ids = sorted(names)  # category ids (1-90 in COCO itself) -> labels 0..K-1
    index = {c: k for k, c in enumerate(ids)}
    for item in train + (held or []):
        item.labels = [index[c] for c in item.labels]
    return _finish("coco", root, opts, [names[c] for c in ids], train, held, skipped,
                   [files[train_name]] + ([files[held_name]] if held_name else []))


# --- YOLO -------------------------------------------------------------------------------------------

def _yolo_split(images: Path, labels: Path, root: Path, skip_bad: bool, skipped: list) -> list[_Annotated]:
    items = []
    for path in _image_files(images):
        item = _Annotated(path)
        label_file = (labels / path.relative_to(images)).with_suffix(".txt")
        if label_file.is_file():  # (no label file: an image without objects, as YOLO reads it)
            for number, line in enumerate(label_file.read_text().splitlines(), 1):
                fields = line.split()
                if not fields:
                    continue
                where = f"{label_file.relative_to(root)} line {number}"
                try:
                    cls, cx, cy, w, h = int(fields[0]), *(float(v) for v in fields[1:5])
                    if len(fields) != 5 or cls < 0:
                        raise ValueError
                except ValueError:
                    raise GpuaccelError(f"{where}: {line.strip()!r} is not 'class cx cy w h' (a class number and "
                                        f"four coordinates from 0 to 1)") from None
                box = _checked_box(cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2, 1.0, 1.0, where, skip_bad, skipped,
                                   slack=0.005)
                if box is not None:
                    item.boxes.append(box)
                    item.labels.append(cls)
        items.append(item)
    if not items:
        raise GpuaccelError(f"{images} holds no images")
    return items


def _paired_splits(root: Path, sub: str, read_split, skip_bad: bool, skipped: list):
    """(training items, held-out items or None) of ``images/`` beside ``sub/`` (labels, masks),
    split alike: ``read_split(images folder, sub folder, root, skip_bad, skipped)`` per split."""
    image_splits, paired = _split_folders(root, "images"), _split_folders(root, sub)
    if image_splits.keys() != paired.keys():
        raise GpuaccelError(f"{root}: images/ and {sub}/ must have the same split folders (train, val)")
    parts = {split: read_split(folder, paired[split], root, skip_bad, skipped) for split, folder in image_splits.items()}
    return parts.get("train", parts.get(None)), parts.get("val")


def read_yolo(root: Path, opts) -> SceneDataset:
    skipped: list[str] = []
    train, held = _paired_splits(root, "labels", _yolo_split, opts.skip_bad, skipped)
    highest = max([c for item in train + (held or []) for c in item.labels] + [0])
    names = class_names(root) or [str(k) for k in range(highest + 1)]
    if highest >= len(names):
        raise GpuaccelError(f"{root}: a label has class {highest}, but {len(names)} class names are given "
                            f"(classes.txt or data.yaml)")
    return _finish("yolo", root, opts, names, train, held, skipped,
                   [p for p in (root / "classes.txt", root / "data.yaml") if p.is_file()])


# --- masks ------------------------------------------------------------------------------------------

def _mask_split(images: Path, masks: Path, root: Path, skip_bad: bool, skipped: list) -> list[_Annotated]:
    items = []
    for path in _image_files(images):
        mask = (masks / path.relative_to(images)).with_suffix(".png")
        if not mask.is_file():
            if not skip_bad:
                raise GpuaccelError(f"image {path.relative_to(root)} has no mask {mask.relative_to(root)}; "
                                    f"pass --skip-bad to leave such images out")
            skipped.append(f"{path.relative_to(root)} (no mask)")
            continue
        items.append(_Annotated(path, mask=mask))
    if not items:
        raise GpuaccelError(f"{images} holds no images with masks")
    return items


def read_masks(root: Path, opts) -> SceneDataset:
    skipped: list[str] = []
    train, held = _paired_splits(root, "masks", _mask_split, opts.skip_bad, skipped)
    return _finish("masks", root, opts, None, train, held, skipped,
                   [p for p in (root / "classes.txt", root / "data.yaml") if p.is_file()])


def _mask_classes(root: Path, highest: int) -> list[str]:
    """The object classes of masks whose largest class value is ``highest``."""
    names = class_names(root)
    if names is None and _coco_files(root):  # (category id = mask value, as digit scenes write them)
        categories = json.loads(next(iter(_coco_files(root).values())).read_text()).get("categories", [])
        by_id = {c["id"]: str(c.get("name", c["id"])) for c in categories}
        if all(k in by_id for k in range(1, highest + 1)):
            names = [by_id[k] for k in range(1, max(by_id) + 1)]
    if names is not None and len(names) == highest + 1 and names[0].lower() in ("background", "bg", "_background_"):
        names = names[1:]
    names = names or [str(k) for k in range(1, highest + 1)]
    if highest > len(names):
        raise GpuaccelError(f"{root}: a mask has class {highest}, but {len(names)} class names are given")
    return names


# --- the rest, shared -----------------------------------------------------------------------------

def _finish(reader: str, root: Path, opts, names, train: list[_Annotated], held: list[_Annotated] | None,
            skipped: list, extra_files: list[Path]) -> SceneDataset:
    with_masks = reader == "masks"
    files = sorted({i.path for i in train + (held or [])} | {i.mask for i in train + (held or []) if i.mask}
                   | set(extra_files))
    options = {"image_size": opts.image_size, "skip_bad": opts.skip_bad, "held_out": held is not None,
               "val_split": opts.val_split, "seed": opts.seed}
    key, fingerprint = cache.file_identity(f"scenes-{reader}", root, files, options)
    stored = cache.load(opts.cache_dir, key)
    if stored is not None:
        meta = stored.pop("meta")
        splits = [SceneSplit(**{k[len(p) + 1:]: v for k, v in stored.items() if k.startswith(p + "_")},
                             names=meta[f"{p}_names"]) for p in ("train", "test")]
        return SceneDataset(root.name, "segmentation" if with_masks else "detection", splits[0], splits[1],
                            meta["classes"], str(root), meta["skipped"], fingerprint)
    if held is None:
        fraction = opts.val_split if opts.val_split is not None else 0.1
        if not 0.0 < fraction < 1.0:
            raise GpuaccelError(f"--val-split must be between 0 and 1 (exclusive), got {fraction}")
        order = list(range(len(train)))
        random.Random(opts.seed).shuffle(order)
        count = min(max(1, round(len(train) * fraction)), len(train) - 1)
        held, train = [train[k] for k in sorted(order[:count])], [train[k] for k in sorted(order[count:])]
    elif opts.val_split is not None:
        raise GpuaccelError(f"{root} already has a held-out split; --val-split is only for data without one")
    train_split = _decode(train, root, opts.image_size, opts.skip_bad, skipped, with_masks)
    h, w = train_split.images.shape[2:]  # (held-out images are brought to the training images' size)
    test_split = _decode(held, root, opts.image_size or (h if h == w else None), opts.skip_bad, skipped, with_masks)
    if test_split.images.shape[1:] != train_split.images.shape[1:]:
        raise GpuaccelError(f"{root}: training images are {train_split.images.shape[1:]} (C, H, W), held-out images "
                            f"{test_split.images.shape[1:]}; pass --image-size N to bring both to NxN")
    if with_masks:
        values = np.unique(np.concatenate([np.unique(train_split.masks), np.unique(test_split.masks)]))
        names = _mask_classes(root, int(values[values != IGNORE].max(initial=0)))
    if skipped:
        warnings.warn(f"{len(skipped)} {'images or boxes' if not with_masks else 'images'} left out of {root} "
                      f"(--skip-bad), e.g. {skipped[0]}", stacklevel=3)
    meta = {"classes": list(names), "skipped": skipped, "train_names": train_split.names,
            "test_names": test_split.names}
    arrays = {f"{p}_{k}": getattr(s, k) for p, s in (("train", train_split), ("test", test_split))
              for k in ("images", "boxes", "labels", "masks") if getattr(s, k) is not None}
    cache.save(opts.cache_dir, key, meta, **arrays)
    return SceneDataset(root.name, "segmentation" if with_masks else "detection", train_split, test_split,
                        list(names), str(root), skipped, fingerprint)


READERS = {"coco": read_coco, "yolo": read_yolo, "masks": read_masks}


def load_scenes(path: Path, kind: str, *, image_size: int | None = None, skip_bad: bool = False,
                val_split: float | None = None, seed: int = 0, cache_dir=None) -> SceneDataset:
    from .formats import ReadOptions

    if image_size is not None and image_size < 16:
        raise GpuaccelError(f"--image-size must be at least 16 pixels for detection or segmentation, got {image_size}")
    return READERS[kind](Path(path), ReadOptions(val_split=val_split, image_size=image_size, skip_bad=skip_bad,
                                                 seed=seed, cache_dir=Path(cache_dir) if cache_dir else None))
