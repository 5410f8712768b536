"""The one on-disk form of a run's state, written by both doors: ``Trainer``'s checkpoint.pt and
model.pt, and ``Accelerator.save``. A file is a dict of named states (a model's, an optimizer's,
a scheduler's, plain values) with a header naming the format and its version, written atomically
(``files.atomic_write``: the old file or the new one, never half of one). Each door reads the
other's: ``acc.load(checkpoint.pt, model=..., optimizer=...)`` takes a Trainer's weights and
optimizer state.

Also here, the other pieces of state both doors keep alike: the random number generators'
(:func:`rng_state`), and an in-memory copy of state to put back (:func:`snapshot`, the warm-up's).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import GpuaccelError
from ..files import atomic_write

FORMAT = "gpuaccel-checkpoint"
VERSION = 1
RNG = "_rng"  # the key under which a file keeps the random number generators' states


def write_state(path: Path, state: dict) -> None:
    """Writes ``state`` (names to states) with the format's header, atomically, and without the
    zip records' CRC-32 checksums: ``torch.load`` never checks them (a changed byte loads as it
    is, checksum or not), and computing them took a third of the time to write 1.2 GB on an H200's
    host (1.52 s, 0.99 s without; benchmarks/cold_start/results/host_copies_h200.json). Unzipping
    the file by hand warns about them."""
    atomic_write(Path(path), lambda f: save_without_checksums({"format": FORMAT, "version": VERSION, **state}, f))


def save_without_checksums(obj, f) -> None:
    """``torch.save`` with ``torch.serialization.set_crc32_options(False)``, put back after."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(obj, f)
    finally:
        torch.serialization.set_crc32_options(before)


def read_state(path: Path, map_location="cpu", *, unversioned=None) -> dict:
    """Reads a file :func:`write_state` wrote; anything else is one line, not a traceback.
    ``unversioned(state)``: whether a dict without the header is accepted anyway (the files
    ``Accelerator.save`` wrote before it wrote the header)."""
    path = Path(path)
    if not path.is_file():
        raise GpuaccelError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises many types for a file that is not a checkpoint
        raise GpuaccelError(f"{path} is not a readable gpuaccel checkpoint ({type(exc).__name__})") from None
    if isinstance(state, dict) and "format" not in state and unversioned is not None and unversioned(state):
        return state
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise GpuaccelError(f"{path} is not a gpuaccel checkpoint")
    version = state.get("version", 0)
    if isinstance(version, bool) or not isinstance(version, int):
        raise GpuaccelError(f"{path}: its format version {version!r} is not a whole number; it is not a checkpoint "
                            f"gpuaccel wrote (or it was edited)")
    if version > VERSION:
        raise GpuaccelError(f"{path} was written by a newer gpuaccel (format {state['version']}); upgrade gpuaccel")
    return state


def rng_state() -> dict:
    """The random number generators' states: the CPU's and every visible GPU's."""
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    """Puts back what :func:`rng_state` returned (GPUs the saving process had and this one lacks are
    left out)."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][:torch.cuda.device_count()])


def snapshot(state: dict, device: torch.device) -> dict:
    """A copy of ``state`` to put back later: beside the original while the GPU has twice its size
    free, else in host memory (a model of tens of gigabytes, e.g. DLRM's tables, would otherwise
    need its size again on the GPU)."""
    on_gpu = sum(t.numel() * t.element_size() for t in tree_flatten(state)[0]
                 if isinstance(t, torch.Tensor) and t.is_cuda)
    if on_gpu and torch.cuda.mem_get_info(device)[0] < 2 * on_gpu:
        return tree_map(lambda t: t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor)
                        else copy.deepcopy(t), state)
    return copy.deepcopy(state)
