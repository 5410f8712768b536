"""Decoding image files into uint8 arrays, once, on every CPU core.

Mixed sizes: with ``image_size`` every image is resized (antialiased) to that square
size; without it the most common size wins and images of any other size are
resized to it, with a warning naming how many. Channels: grayscale, palette, RGBA
and CMYK images are all converted; if any image has colour the data set is RGB
(grayscale images repeated over three channels), otherwise it stays one channel.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import warnings
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..errors import GpuaccelError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm")
GRAY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"}


def is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


@dataclass
class ImageSource:
    """One image to decode: its name (for messages) and either a path or its bytes."""

    name: str
    path: str | None = None
    data: bytes | None = None


def not_a_regular_file(path) -> str | None:
    """Why ``path`` is not a file that can be read to its end (a FIFO would block a reader for
    ever, a device such as /dev/zero never ends), or None for a regular file (or one that is
    gone: its reader says so)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or \
        stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
    return f"{kind}, not a regular file"


def _decode_one(source: ImageSource, size: int | None, upright: list | None = None):
    """Returns (HWC uint8 array, None) or (None, reason); never raises for a bad file. ``upright``:
    a list the image's own (width, height), turned upright, is appended to (before any resizing)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if source.data is None:
        odd = not_a_regular_file(source.path)
        if odd is not None:
            return None, odd
    try:
        with Image.open(source.path if source.data is None else io.BytesIO(source.data)) as img:
            img.load()  # forces a full decode, so a truncated file fails here, not later
            img = ImageOps.exif_transpose(img)  # upright, as viewers show it (a camera's EXIF orientation)
            if img.mode in ("I;16", "I;16B", "I;16L", "I"):
                array = (np.asarray(img, dtype=np.float64) / 256.0).clip(0, 255).astype(np.uint8)
                img = Image.fromarray(array, mode="L")
            elif img.mode in GRAY_MODES:
                img = img.convert("L")
            else:
                img = img.convert("RGB")
            if upright is not None:
                upright.append(img.size)
            if size is not None and img.size != (size, size):
                img = img.resize((size, size), Image.Resampling.BILINEAR, reducing_gap=None)
            array = np.asarray(img, dtype=np.uint8)
    except Image.DecompressionBombError as exc:  # Pillow's guard against a file that inflates to gigapixels
        return None, f"too large to decode safely ({exc})"
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if array.ndim == 2:
        array = array[:, :, None]
    return array, None


def why_unreadable(path: str) -> str:
    """Why an image file that failed to decode cannot be used, in words a user acts on."""
    _, reason = _decode_one(ImageSource(path, path), None)
    if reason is None:
        return "not a readable image"
    if reason.startswith("PermissionError"):
        return "permission denied: this user may not read the file"
    if reason.startswith(("FileNotFoundError", "IsADirectoryError")):
        return "the file is gone"
    if reason.endswith("not a regular file"):
        return reason
    return f"not a readable image ({reason})"


def _decode_chunk(args):
    """(array, reason, the image's own upright (width, height) or None) of each source."""
    sources, size = args
    results = []
    for source in sources:
        upright = []
        array, reason = _decode_one(source, size, upright)
        results.append((array, reason, upright[0] if array is not None else None))
    return results


def gpu_jpeg_decoder_available(device) -> bool:
    """Batched JPEG decoding on the GPU needs a CUDA device and torchvision's nvJPEG bindings."""
    if device is None or getattr(device, "type", str(device).split(":")[0]) != "cuda":
        return False
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None  # found without the cost of importing it


def _is_jpeg(source: ImageSource) -> bool:
    return source.name.lower().endswith((".jpg", ".jpeg"))


def _decode_on_gpu(sources: list[ImageSource], device, batch: int = 2048):
    """Decodes JPEGs in batches with nvJPEG (torchvision.io.decode_jpeg on the GPU).

    A batch that nvJPEG rejects (a corrupt file, CMYK, progressive quirks) is decoded again
    on the CPU, one file at a time, so bad files are named exactly as on the CPU path. So is
    a JPEG whose EXIF orientation says it is stored on its side: Pillow turns it upright."""
    import torch
    from concurrent.futures import ThreadPoolExecutor
    from torchvision.io import ImageReadMode

    from . import nvjpeg

    def read(source):
        if source.data is not None:
            return source.data
        if not_a_regular_file(source.path):
            return b""  # (no JPEG: decoded on the CPU, which names why)
        with open(source.path, "rb") as f:
            return f.read()

    results = []
    with ThreadPoolExecutor(max_workers=min(16, (os.cpu_count() or 1) * 2)) as pool:
        for start in range(0, len(sources), batch):
            part = sources[start:start + batch]
            blobs = list(pool.map(read, part))
            arrays: list = [None] * len(part)
            on_gpu = []
            for k, (source, blob) in enumerate(zip(part, blobs)):
                header = nvjpeg.frame(blob)
                if header is not None and header.orientation != 1:  # nvJPEG would leave it on its side
                    arrays[k] = _decode_one(ImageSource(source.name, data=blob), None)
                else:
                    on_gpu.append(k)
            if on_gpu:
                raw = [torch.frombuffer(bytearray(blobs[k]), dtype=torch.uint8) for k in on_gpu]
                try:
                    decoded = nvjpeg.torchvision_decode(raw, ImageReadMode.UNCHANGED, device)
                except RuntimeError:
                    for k in on_gpu:
                        arrays[k] = _decode_one(part[k], None)
                else:
                    # one device-to-host copy per image shape, not one per image
                    by_shape: dict[tuple, list[int]] = {}
                    for i, img in enumerate(decoded):
                        by_shape.setdefault(tuple(img.shape), []).append(i)
                    for members in by_shape.values():
                        host = torch.stack([decoded[i] for i in members]).permute(0, 2, 3, 1).cpu().numpy()
                        for j, i in enumerate(members):
                            arrays[on_gpu[i]] = (host[j], None)
            results.extend(arrays)
    return results


def decode_images(sources: list[ImageSource], *, image_size: int | None = None, skip_bad: bool = False,
                  workers: int | None = None, device=None, pool=None, sizes: bool = False, view: bool = False):
    """Decodes ``sources`` into one (N, C, H, W) uint8 array: JPEGs on the GPU in batches when
    ``device`` is a CUDA device and torchvision is installed, otherwise on every CPU core.

    Returns (images, kept_indices, bad_names), and with ``sizes`` the kept images' own (width,
    height), upright, before any resizing. A file that cannot be decoded raises a GpuaccelError
    naming it, unless ``skip_bad``, which drops and reports it. ``pool``: a process pool to decode
    on (a caller decoding chunk after chunk keeps one), instead of a new one. ``view``: where the
    decoding processes wrote every image, in colour, into the shared memory of :func:`_shared_rows`,
    the array is that memory seen as (N, C, H, W) (channels-last strides), not a copy laid out anew:
    a caller that reads it a batch at a time holds one copy of the images, not two.
    """
    if not sources:
        raise GpuaccelError("no images to decode")
    whole = None  # (every image, (N, H, W, 3), where the decoders wrote them into shared memory)
    if gpu_jpeg_decoder_available(device) and all(_is_jpeg(s) for s in sources):
        results = _decode_on_gpu(sources, device)
    else:
        results, whole = _decode_on_cpu(sources, image_size, workers, pool)

    arrays, kept, bad, own_sizes = [], [], [], []
    for index, (source, (array, reason, *upright)) in enumerate(zip(sources, results)):
        if array is None:
            if not skip_bad:
                raise GpuaccelError(f"cannot decode image {source.name} ({reason}); "
                                    f"fix or remove it, or pass --skip-bad to skip bad images")
            bad.append(source.name)
            continue
        arrays.append(array)
        kept.append(index)
        own_sizes.append(upright[0] if upright else (array.shape[1], array.shape[0]))  # (the GPU's: not resized)
    if not arrays:
        raise GpuaccelError(f"none of the {len(sources)} images could be decoded")

    channels = 3 if any(a.shape[2] == 3 for a in arrays) else 1
    shapes = Counter(a.shape[:2] for a in arrays)
    target = shapes.most_common(1)[0][0]
    if len(shapes) > 1:
        odd = sum(n for s, n in shapes.items() if s != target)
        warnings.warn(f"{odd} of {len(arrays)} images are not {target[1]}x{target[0]}; resized to it "
                      f"(pass --image-size N to choose the size)", stacklevel=2)
    if view and whole is not None and len(arrays) == len(sources) and channels == 3 and \
            all(a.shape == (*target, 3) for a in arrays):
        out = whole.transpose(0, 3, 1, 2)
        return (out, kept, bad, own_sizes) if sizes else (out, kept, bad)
    out = np.empty((len(arrays), channels, target[0], target[1]), dtype=np.uint8)
    if all(a.shape == (*target, channels) for a in arrays):  # (the usual case: one copy, in C)
        np.stack([a.transpose(2, 0, 1) for a in arrays], out=out)
    else:
        for i, array in enumerate(arrays):
            if array.shape[:2] != target:
                array = _resize(array, target)
            out[i] = array.transpose(2, 0, 1)  # a grayscale image broadcasts over RGB
    return (out, kept, bad, own_sizes) if sizes else (out, kept, bad)


def _decode_on_cpu(sources: list[ImageSource], image_size: int | None, workers: int | None, pool=None):
    """(each source's (image or None, why not, upright size), and the (N, H, W, 3) array in shared
    memory that the images are views of where the decoders wrote them there, else None)."""
    workers = workers or os.cpu_count() or 1
    chunk = max(1, min(256, len(sources) // (workers * 4) or 1))
    starts = range(0, len(sources), chunk)
    if pool is None and (workers == 1 or len(sources) < 512):
        return [r for i in starts for r in _decode_chunk((sources[i:i + chunk], image_size))], None
    with contextlib.ExitStack() as stack:
        if pool is None:
            pool = stack.enter_context(ProcessPoolExecutor(max_workers=workers))
        shared = _shared_rows(len(sources), image_size) if image_size is not None else None
        if shared is None:
            return [r for part in pool.map(_decode_chunk, [(sources[i:i + chunk], image_size) for i in starts])
                    for r in part], None
        fd, rows = shared
        try:
            parts = pool.map(_decode_chunk_into, [(sources[i:i + chunk], image_size, rows, len(sources), i)
                                                  for i in starts])
            results = [r for part in parts for r in part]
            images = np.memmap(rows, dtype=np.uint8, mode="r", shape=(len(sources), image_size, image_size, 3))
            images = images.view(np.ndarray)  # (a memmap's every slice costs 15 us of Python; an array's does not)
        finally:
            os.close(fd)  # (the mapping stays readable until its last view is gone; then the memory is freed)
    return [(images[i, :, :, :channels] if channels else None, reason, upright)
            for i, (channels, reason, upright) in enumerate(results)], images


def _shared_rows(count: int, size: int) -> tuple[int, str] | None:
    """An anonymous file in memory with room for ``count`` RGB images of ``size`` x ``size``, which
    decoding processes open by its path and write into instead of sending their images back
    through pipes (50,000 frames of 128 px are 2.4 GB to pickle, send and unpickle): (its
    descriptor, the path they open). It has no name in any folder, so however this process ends
    its memory is freed, and a container's small /dev/shm does not limit it. None where the system
    has no such files (Linux's memfd_create and /proc): the images then come back through pipes."""
    path = f"/proc/{os.getpid()}/fd"
    if not hasattr(os, "memfd_create") or not os.path.isdir(path):
        return None
    fd = os.memfd_create("gpuaccel-decoded", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, count * size * size * 3)
    except OSError:
        os.close(fd)
        return None
    return fd, f"{path}/{fd}"


def _decode_chunk_into(args):
    """:func:`_decode_chunk` writing image ``k`` into row ``first + k`` of the shared file ``rows``
    ((count, size, size, 3) uint8) and returning its channel count in the array's place."""
    sources, size, rows, count, first = args
    images = np.memmap(rows, dtype=np.uint8, mode="r+", shape=(count, size, size, 3))
    results = []
    for k, (array, reason, upright) in enumerate(_decode_chunk((sources, size))):
        if array is not None:
            images[first + k, :, :, :array.shape[2]] = array
        results.append((None if array is None else array.shape[2], reason, upright))
    return results


def _resize(array: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    from PIL import Image

    img = Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array)
    resized = np.asarray(img.resize((hw[1], hw[0]), Image.Resampling.BILINEAR), dtype=np.uint8)
    return resized[:, :, None] if resized.ndim == 2 else resized
