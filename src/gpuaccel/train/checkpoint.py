"""Crash-safe checkpoints: a checkpoint on disk is always either the old one or the new one.

Written through :func:`gpuaccel.files.atomic_write`: a temporary file in the same
directory, fsynced, renamed over the old one, and the directory fsynced.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import GpuaccelError
from ..files import atomic_write, write_json  # noqa: F401  (checkpoints are written through these)

FORMAT = "gpuaccel-checkpoint"
VERSION = 1


def save(path: Path, state: dict) -> None:
    atomic_write(path, lambda f: torch.save({"format": FORMAT, "version": VERSION, **state}, f))


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
