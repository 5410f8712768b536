"""Crash-safe checkpoints: a checkpoint on disk is always either the old one or the new one.

Written to a temporary file in the same directory, flushed and fsynced, then renamed
over the old file (rename is atomic on POSIX file systems), then the directory is
fsynced so the rename itself survives a power cut.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from ..errors import GpuaccelError

FORMAT = "gpuaccel-checkpoint"
VERSION = 1


def atomic_write(path: Path, write) -> None:
    """Calls ``write(file)`` on a temporary file, then moves it to ``path`` atomically."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save(path: Path, state: dict) -> None:
    atomic_write(path, lambda f: torch.save({"format": FORMAT, "version": VERSION, **state}, f))


def write_json(path: Path, data) -> None:
    atomic_write(path, lambda f: f.write((json.dumps(data, indent=2, default=str) + "\n").encode()))


def load(path: Path, map_location="cpu") -> dict:
    """Reads a gpuaccel checkpoint; anything else is a user error, not a traceback."""
    path = Path(path)
    if not path.is_file():
        raise GpuaccelError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises many types for a file that is not a checkpoint
        raise GpuaccelError(f"{path} is not a readable gpuaccel checkpoint ({type(exc).__name__})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise GpuaccelError(f"{path} is not a gpuaccel checkpoint")
    if state.get("version", 0) > VERSION:
        raise GpuaccelError(f"{path} was written by a newer gpuaccel (format {state['version']}); upgrade gpuaccel")
    return state
