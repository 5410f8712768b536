"""Readers for the data formats users bring, each producing an :class:`ImageDataset`.

Every reader takes the path and a :class:`ReadOptions`; the splitting of data sets
without a test split and the decoded-file cache are shared (see ``_finish``).
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import pickle
import struct
import tarfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import GpuaccelError
from . import cache
from .dataset import ImageDataset, stratified_split
from .images import ImageSource, decode_images, gpu_jpeg_decoder_available, is_image_name

TEST_SPLIT_NAMES = ("test", "val", "valid", "validation")


@dataclass
class ReadOptions:
    val_split: float | None = None
    image_size: int | None = None
    skip_bad: bool = False
    seed: int = 0
    cache_dir: Path | None = None
    decode_device: object = None  # a CUDA device decodes JPEGs on the GPU (with torchvision)


def _finish(name, source, opts, train_x, train_y, classes, test_x=None, test_y=None, skipped=(),
            default_val_split=0.1) -> ImageDataset:
    """Carves a held-out split where the data has none, then builds the data set."""
    held_out = "its test split"
    if test_x is None:
        fraction = opts.val_split if opts.val_split is not None else default_val_split
        train_x, train_y, test_x, test_y = stratified_split(train_x, np.asarray(train_y), fraction, opts.seed)
        held_out = f"{fraction:.0%} of its images held out by class, seed {opts.seed}"
    elif opts.val_split is not None:
        raise GpuaccelError(f"{source} already has a test split; --val-split is only for data without one")
    return ImageDataset(name, train_x, train_y, test_x, test_y, list(classes), source=str(source),
                        skipped=list(skipped), held_out=held_out)


# --- digits: scikit-learn's bundled 8x8 handwritten digits ---------------------------------------

def read_digits(path, opts: ReadOptions) -> ImageDataset:
    pixels, labels = bundled_digits()
    images = np.round(pixels * (255.0 / 16.0)).astype(np.uint8)[:, None]
    return _finish("digits", "digits (scikit-learn)", opts, images, labels, [str(c) for c in range(10)],
                   default_val_split=0.2)


def bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 digits as (images (n, 8, 8), values 0-16; labels (n,)), read from the
    file scikit-learn ships them in, as its ``load_digits`` reads it. Importing ``sklearn.datasets``
    to call that took 1.5 s of every command on the digits (it imports SciPy), more than the rest
    of a demo's set-up; the file takes 0.03 s. Where scikit-learn lays its files out otherwise,
    ``load_digits`` reads them."""
    spec = importlib.util.find_spec("sklearn")  # (finds the package without importing it)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt") as f:
                rows = np.loadtxt(f, delimiter=",")
            if rows.ndim == 2 and rows.shape[1] == 65:  # 64 pixels and the label
                return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(int)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images, bunch.target


# --- MNIST / Fashion-MNIST IDX files ---------------------------------------------------------------

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path) -> np.ndarray:
    """Parses one IDX file (gzip or raw): two zero bytes, a type code, the rank, big-endian dims."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as exc:
        raise GpuaccelError(f"cannot read IDX file {path}: {exc}") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise GpuaccelError(f"{path} is not an IDX file (bad magic number)")
    ndim = data[3]
    dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    body = data[4 + 4 * ndim:]
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(body) != expected:
        raise GpuaccelError(f"{path} is truncated or padded: {len(body)} data bytes, header says {expected}")
    return np.frombuffer(body, dtype=dtype).reshape(dims)


def _find_one(directory: Path, prefixes, marker) -> Path | None:
    for entry in sorted(directory.iterdir()):
        name = entry.name.lower()
        if marker in name and name.startswith(prefixes):
            return entry
    return None


FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                   "Ankle boot"]


def read_mnist(path, opts: ReadOptions) -> ImageDataset:
    directory = Path(path)
    files = {
        "train_x": _find_one(directory, ("train-images", "train_images"), "idx3"),
        "train_y": _find_one(directory, ("train-labels", "train_labels"), "idx1"),
        "test_x": _find_one(directory, ("t10k-images", "test-images", "test_images"), "idx3"),
        "test_y": _find_one(directory, ("t10k-labels", "test-labels", "test_labels"), "idx1"),
    }
    if files["train_x"] is None or files["train_y"] is None:
        raise GpuaccelError(f"{directory}: no train-images-idx3-ubyte[.gz] / train-labels-idx1-ubyte[.gz] pair")
    if (files["test_x"] is None) != (files["test_y"] is None):
        raise GpuaccelError(f"{directory}: test images and test labels must come together (t10k-images/t10k-labels)")
    arrays = {k: (read_idx(p) if p is not None else None) for k, p in files.items()}
    for key in ("train_x", "test_x"):
        x = arrays[key]
        if x is not None:
            if x.ndim != 3 or x.dtype != np.uint8:
                raise GpuaccelError(f"{files[key]}: expected uint8 images of rank 3, got {x.dtype} rank {x.ndim}")
            arrays[key] = x[:, None]
    fashion = "fashion" in str(directory).lower()
    return _finish("fashion-mnist" if fashion else "mnist", directory, opts, arrays["train_x"], arrays["train_y"],
                   FASHION_CLASSES if fashion else [str(i) for i in range(10)], arrays["test_x"], arrays["test_y"])


# --- CIFAR-10 / CIFAR-100 python pickle batches ------------------------------------------------------

def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise GpuaccelError(f"cannot read CIFAR batch {path}: {exc}") from None
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in batch.items()}


def _cifar_images(batch: dict, path: Path) -> np.ndarray:
    data = np.asarray(batch["data"], dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != 3072:
        raise GpuaccelError(f"{path}: expected rows of 3072 bytes (3x32x32), got shape {data.shape}")
    return data.reshape(-1, 3, 32, 32)


def _names(values) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]


# the two layouts: (name, training files, test file, label key, meta file, class-names key, classes)
_CIFAR_LAYOUTS = (("cifar10", "data_batch_*", "test_batch", "labels", "batches.meta", "label_names", 10),
                  ("cifar100", "train", "test", "fine_labels", "meta", "fine_label_names", 100))


def _read_batches(files: list[Path], label_key: str):
    batches = [_unpickle(p) for p in files]
    images = np.concatenate([_cifar_images(b, p) for b, p in zip(batches, files)])
    return images, np.concatenate([np.asarray(b[label_key]) for b in batches])


def read_cifar(path, opts: ReadOptions) -> ImageDataset:
    directory = Path(path)
    for wrapper in ("cifar-10-batches-py", "cifar-100-python"):
        if (directory / wrapper).is_dir():
            directory = directory / wrapper
    for name, train_glob, test_name, label_key, meta_name, names_key, count in _CIFAR_LAYOUTS:
        train_files = sorted(p for p in directory.glob(train_glob) if p.is_file())
        if train_files:
            break
    else:
        raise GpuaccelError(f"{path}: no CIFAR batches (data_batch_1..5 + test_batch, or train + test)")
    train_x, train_y = _read_batches(train_files, label_key)
    test_file = directory / test_name
    test_x, test_y = _read_batches([test_file], label_key) if test_file.is_file() else (None, None)
    meta = directory / meta_name
    classes = _names(_unpickle(meta)[names_key]) if meta.exists() else [str(i) for i in range(count)]
    return _finish(name, directory, opts, train_x, train_y, classes, test_x, test_y)


# --- ImageFolder trees, on disk or inside a tar archive -------------------------------------------------

def split_tree(names: list[str]):
    """Groups image names 'split/class/file' or 'class/file' (relative to the tree's root).

    Returns ({split: {class: [names]}}, has_splits). A tree whose top level holds a
    'train' folder is split; any other tree is one set of classes.
    """
    top_dirs = {n.split("/", 1)[0] for n in names if "/" in n}
    has_splits = "train" in top_dirs
    splits: dict[str, dict[str, list[str]]] = {}
    for name in names:
        parts = name.split("/")
        if has_splits:
            if len(parts) < 3 or parts[0] not in ("train",) + TEST_SPLIT_NAMES:
                continue
            split, cls = ("train" if parts[0] == "train" else "test"), parts[1]
        else:
            if len(parts) < 2:
                continue
            split, cls = "train", parts[0]
        splits.setdefault(split, {}).setdefault(cls, []).append(name)
    return splits, has_splits


def common_root(names: list[str]) -> str:
    """A tar made of 'cifar10/train/...' has one top folder wrapping the tree: strip it."""
    tops = {n.split("/", 1)[0] for n in names}
    if len(tops) == 1 and all("/" in n for n in names):
        top = tops.pop()
        if top not in ("train",) + TEST_SPLIT_NAMES:
            inner = [n.split("/", 1)[1] for n in names]
            if any("/" in n for n in inner):
                return top + "/"
    return ""


def _folder_dataset(name, source, opts, image_names, all_dirs, fetch, reader, fingerprint) -> ImageDataset:
    """Shared by the folder and tar readers: class discovery, decode (cached), labels."""
    root = common_root(image_names) if image_names else ""
    rel = [n[len(root):] for n in image_names]
    dirs = {d[len(root):] for d in all_dirs if d.startswith(root)}
    splits, has_splits = split_tree(rel)
    if "train" not in splits:
        raise GpuaccelError(f"{source}: no images found in class folders (expected train/<class>/*.jpg or <class>/*.jpg)")
    classes = sorted(splits["train"])
    # a class folder with no image in it is almost always a mistake worth stopping for
    prefix = "train/" if has_splits else ""
    for d in sorted(dirs):
        if d.startswith(prefix) and d.count("/") == prefix.count("/") and d[len(prefix):] and d[len(prefix):] not in classes:
            raise GpuaccelError(f"{source}: class folder {root + d!r} holds no images")
    unknown = sorted(set(splits.get("test", {})) - set(classes))
    if unknown:
        raise GpuaccelError(f"{source}: test classes {unknown} do not appear in the training split")

    # nvJPEG and Pillow differ in the last bit of some pixels: each decoder has its own entry
    decoder = "nvjpeg" if gpu_jpeg_decoder_available(opts.decode_device) else "pil"
    options = {"image_size": opts.image_size, "skip_bad": opts.skip_bad, "decoder": decoder}
    key = cache.cache_key(reader, fingerprint, options)
    hit = cache.load(opts.cache_dir, key)
    if hit is not None:
        arrays, meta = hit, hit["meta"]
    else:
        ordered = [(split, cls, n) for split in ("train", "test") for cls in sorted(splits.get(split, {}))
                   for n in sorted(splits[split][cls])]
        images, kept, bad = decode_images([fetch(root + n) for _, _, n in ordered], image_size=opts.image_size,
                                          skip_bad=opts.skip_bad, device=opts.decode_device)
        index = {c: i for i, c in enumerate(classes)}
        labels = np.array([index[ordered[k][1]] for k in kept], dtype=np.int64)
        is_test = np.array([ordered[k][0] == "test" for k in kept], dtype=bool)
        meta = {"classes": classes, "bad": bad}
        arrays = {"images": images, "labels": labels, "is_test": is_test}
        cache.save(opts.cache_dir, key, meta, **arrays)
    images, labels, is_test = arrays["images"], arrays["labels"], arrays["is_test"].astype(bool)
    if "test" in splits:
        train_count = int(np.count_nonzero(~is_test))
        if is_test[train_count:].all():  # decoded train first, then test: views of the array, not copies
            train, test = slice(0, train_count), slice(train_count, None)
        else:
            train, test = ~is_test, is_test
        return _finish(name, source, opts, images[train], labels[train], meta["classes"],
                       images[test], labels[test], skipped=meta["bad"])
    return _finish(name, source, opts, images, labels, meta["classes"], skipped=meta["bad"])


def _dir_key(path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _scan_tree(root: Path):
    """(image names, folder names, fingerprint) below ``root``, names relative with '/'.

    One os.scandir pass: a stat per image, no path objects (a 60,000-file tree takes well
    under a second, which a warm-cache run would otherwise spend here)."""
    images, dirs, fingerprint = [], [], []
    pending = [""]
    seen = {_dir_key(root)}  # folders already listed: a symbolic link back up the tree is a loop
    while pending:
        rel = pending.pop()
        with os.scandir(os.path.join(root, rel) if rel else root) as entries:
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                name = rel + entry.name
                if entry.is_dir():
                    key = _dir_key(os.path.join(root, name))
                    if key in seen:
                        raise GpuaccelError(f"{root}/{name} leads back to a folder already read (a symbolic "
                                            f"link loop or a second link to it); remove the link")
                    seen.add(key)
                    dirs.append(name)
                    pending.append(name + "/")
                elif is_image_name(entry.name):
                    st = entry.stat()
                    images.append(name)
                    fingerprint.append((name, st.st_size, st.st_mtime_ns))
    fingerprint.sort()
    return sorted(images), dirs, fingerprint


def read_image_folder(path, opts: ReadOptions) -> ImageDataset:
    root = Path(path)
    image_names, dirs, fingerprint = _scan_tree(root)
    if not image_names:
        raise GpuaccelError(f"{root}: the data set is empty (no image files found)")
    base = str(root)
    return _folder_dataset(root.name, root, opts, image_names, dirs,
                           lambda n: ImageSource(name=os.path.join(base, n), path=os.path.join(base, n)),
                           "imagefolder", fingerprint)


def read_tar(path, opts: ReadOptions) -> ImageDataset:
    path = Path(path)
    try:
        archive = tarfile.open(path, "r:*")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise GpuaccelError(f"cannot open tar archive {path}: {exc}") from None
    with archive:
        try:
            members = archive.getmembers()
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise GpuaccelError(f"{path} is a damaged tar archive: {exc}") from None
        files = {m.name.lstrip("./"): m for m in members if m.isfile() and is_image_name(m.name)}
        dirs = [m.name.lstrip("./").rstrip("/") for m in members if m.isdir()]
        if not files:
            raise GpuaccelError(f"{path}: the data set is empty (no image files in the archive)")
        st = path.stat()
        fingerprint = [path.name, st.st_size, st.st_mtime_ns]
        # members are read in archive order: one sequential pass over a compressed stream
        contents: dict[str, bytes] = {}

        def fetch(name: str) -> ImageSource:
            if not contents:
                for member in members:
                    key = member.name.lstrip("./")
                    if key in files:
                        contents[key] = archive.extractfile(member).read()
            return ImageSource(name=f"{path}:{name}", data=contents[name])

        name = path.name.split(".")[0]
        return _folder_dataset(name, path, opts, sorted(files), dirs, fetch, "tar", fingerprint)


# --- .npz arrays ------------------------------------------------------------------------------------------

_NPZ_LAYOUTS = (("x_train", "y_train", "x_test", "y_test"),
                ("train_images", "train_labels", "test_images", "test_labels"),
                ("images", "labels", None, None),
                ("x", "y", None, None))


def _to_nchw_uint8(x: np.ndarray, path) -> np.ndarray:
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
        x = x.transpose(0, 3, 1, 2)
    elif x.ndim != 4:
        raise GpuaccelError(f"{path}: images must be (N, H, W), (N, H, W, C) or (N, C, H, W); got {x.shape}")
    if x.shape[1] == 4:
        x = x[:, :3]  # drop alpha
    if x.shape[1] not in (1, 3):
        raise GpuaccelError(f"{path}: images must have 1, 3 or 4 channels; got {x.shape[1]}")
    if x.dtype != np.uint8:
        if not np.issubdtype(x.dtype, np.number):
            raise GpuaccelError(f"{path}: images must be numeric, got {x.dtype}")
        if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
            bad = int((~np.isfinite(x)).sum())
            raise GpuaccelError(f"{path}: {bad} image value(s) are NaN or infinite; replace them before training "
                                f"(gpuaccel does not guess a value)")
        scale = 255.0 if np.issubdtype(x.dtype, np.floating) and float(x.max()) <= 1.0 else 1.0
        x = np.clip(x.astype(np.float64) * scale, 0, 255).round().astype(np.uint8)
    return np.ascontiguousarray(x)


def read_npz(path, opts: ReadOptions) -> ImageDataset:
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError, EOFError) as exc:
        raise GpuaccelError(f"cannot read {path} as .npz: {exc}") from None
    for xk, yk, txk, tyk in _NPZ_LAYOUTS:
        if xk in arrays and yk in arrays:
            break
    else:
        raise GpuaccelError(f"{path}: expected arrays x_train/y_train[/x_test/y_test], "
                            f"train_images/train_labels[/...], or images/labels; found {sorted(arrays)}")
    labels = [np.asarray(arrays[yk])] + ([np.asarray(arrays[tyk])] if tyk in arrays else [])
    for y in labels:
        if not np.issubdtype(y.dtype, np.integer):
            raise GpuaccelError(f"{path}: labels must be integers, got {y.dtype}")
        if (y < 0).any():
            raise GpuaccelError(f"{path}: label {int(y[y < 0][0])} is out of range (labels must be >= 0)")
    if "classes" in arrays:
        classes = [str(c) for c in arrays["classes"]]
    else:
        used = np.unique(np.concatenate(labels))
        classes = [str(int(c)) for c in used]
        if len(used) != int(used.max()) + 1:  # e.g. labels {0, 7}: two classes, not eight
            warnings.warn(f"{path.name}: labels {', '.join(classes[:8])}{', ...' if len(used) > 8 else ''} are "
                          f"used as classes 0..{len(used) - 1} (named by their labels); add a 'classes' array to "
                          f"name them", stacklevel=2)
            labels = [np.searchsorted(used, y) for y in labels]
    train_x = _to_nchw_uint8(arrays[xk], path)
    test_x = _to_nchw_uint8(arrays[txk], path) if txk in arrays else None
    for split, x, y in (("training", train_x, labels[0]), ("test", test_x, labels[-1] if test_x is not None else None)):
        if x is not None and len(x) != len(y):
            raise GpuaccelError(f"{path}: {len(x)} {split} images but {len(y)} labels; they must pair up")
    return _finish(path.stem, path, opts, train_x, labels[0], classes, test_x,
                   labels[1] if test_x is not None else None)


READERS = {
    "digits": read_digits,
    "mnist": read_mnist,
    "idx": read_mnist,
    "fashion-mnist": read_mnist,
    "cifar10": read_cifar,
    "cifar100": read_cifar,
    "cifar": read_cifar,
    "imagefolder": read_image_folder,
    "tar": read_tar,
    "npz": read_npz,
}


def detect_kind(path: Path) -> str:
    """Guesses the format from what is at ``path``."""
    name = path.name.lower()
    if path.is_file():
        if name.endswith(".npz"):
            return "npz"
        if name.endswith((".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")):
            return "tar"
        raise GpuaccelError(f"{path}: cannot tell the format of this file; give a directory, a .tar[.gz] or "
                            f".npz, or name the format as KIND:PATH ({', '.join(sorted(READERS))})")
    entries = {e.name.lower() for e in path.iterdir()}
    if any("idx3-ubyte" in e for e in entries):
        return "mnist"
    if entries & {"data_batch_1", "test_batch", "cifar-10-batches-py", "cifar-100-python"} or \
            ({"train", "meta"} <= entries and (path / "train").is_file()):
        return "cifar10"
    return "imagefolder"
