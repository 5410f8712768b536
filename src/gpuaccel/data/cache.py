"""A disk cache of decoded data sets, so that image files are decoded only once.

The key is a hash of everything the decoded arrays depend on: the reader, each file's
name, size and modification time, and the decoding options. Touching, adding or
removing a file changes the key; stale entries are simply never read again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
import zlib
from pathlib import Path

import numpy as np

from ..caches import cache_root

# Raised whenever what a reader decodes or refuses changes, so that no entry decoded by an
# earlier reader is served: 2: JPEGs decoded upright by their EXIF orientation; 3: ratings rows
# validated (a short row, an empty user or item id, a rating that is not a number or not finite);
# 4: byte-level BPE learned from and applied to a text as a whole (it was encoded line by line)
CACHE_VERSION = 4


def default_cache_dir() -> Path:
    return cache_root() / "datasets"


def cache_key(reader: str, fingerprint, options: dict) -> str:
    payload = json.dumps([CACHE_VERSION, reader, fingerprint, options], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def file_identity(reader: str, root: Path, files: list[Path], options: dict) -> tuple[str, str]:
    """(cache key, fingerprint) of files read with ``options``: their names (relative to ``root``
    when it is a folder), sizes and modification times, so that an edited file is read again and
    a run can tell that its data changed."""
    fingerprint = [(str(f.relative_to(root) if root.is_dir() else f.name), f.stat().st_size, f.stat().st_mtime_ns)
                   for f in files]
    return cache_key(reader, fingerprint, options), fingerprint_digest(fingerprint)


def fingerprint_digest(fingerprint) -> str:
    """A short digest of a data set's file list, which a run records to notice changed data."""
    return hashlib.sha256(json.dumps(fingerprint).encode()).hexdigest()[:16]


def load(cache_dir: Path | None, key: str) -> dict | None:
    if cache_dir is None:
        return None
    path = Path(cache_dir) / f"{key}.npz"
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
        arrays["meta"] = json.loads(str(arrays["meta"]))
        return arrays
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error):
        return None  # a damaged entry (truncated, bits flipped: a bad zip or CRC) is rebuilt rather than trusted


def save(cache_dir: Path | None, key: str, meta: dict, **arrays: np.ndarray) -> None:
    """Writes atomically: a reader never sees a half-written entry."""
    if cache_dir is None:
        return
    cache_dir = Path(cache_dir)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, meta=np.array(json.dumps(meta)), **arrays)
        os.replace(tmp, cache_dir / f"{key}.npz")
    except OSError:
        pass  # a read-only or full cache directory only costs speed
