"""Checkpoints: what they hold (:func:`training_state`) and how a trainer takes it back
(:func:`restore_training_state`); resuming a run is resume.py's.

Crash-safe: a checkpoint on disk is always either the old one or the new one, written through
:func:`gpuaccel.files.atomic_write` (a temporary file in the same directory, fsynced, renamed
over the old one, and the directory fsynced).
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
    version = state.get("version", 0)
    if isinstance(version, bool) or not isinstance(version, int):
        raise GpuaccelError(f"{path}: its format version {version!r} is not a whole number; it is not a checkpoint "
                            f"gpuaccel wrote (or it was edited)")
    if version > VERSION:
        raise GpuaccelError(f"{path} was written by a newer gpuaccel (format {state['version']}); upgrade gpuaccel")
    return state


# ---------------------------------------------------------------------- what a checkpoint holds

def training_state(trainer, full: bool) -> dict:
    """What checkpoint.pt (``full``: everything to continue) and model.pt (the model and what
    rebuilding, exporting and inferring with it needs) hold. Sharded, this gathers the full
    state to rank 0: a collective."""
    model_state, optimizer_state = trainer.strategy.gather_state(trainer.optimizer if full else None)
    inputs, config = trainer.inputs, trainer.config
    state = {"model_name": config.model.name, "model_args": trainer.model_args, "model_path": config.model.model_path,
             "task": trainer.task.describe(), "classes": inputs.classes, "mean": inputs.mean, "std": inputs.std,
             "tokenizer": inputs.tokenizer, "audio": inputs.audio, "ratings": inputs.ratings,
             "data_kind": inputs.data_kind, **inputs.record,
             "data_identity": inputs.identity, "config": config.to_dict(), "model": model_state,
             "ema_model": {k: v.detach().cpu() for k, v in trainer.ema.module.state_dict().items()}
             if trainer.ema else None,
             "accuracy": trainer.state.last_eval.get("accuracy"), "metrics": trainer.state.last_eval,
             "gpuaccel": trainer.version,
             "structure": trainer.structure}
    if full:
        state.update(
            optimizer=optimizer_state, scheduler=trainer.scheduler.state_dict(), scaler=trainer.scaler.state_dict(),
            ema=trainer.ema.state_dict() if trainer.ema else None,
            rng={"torch": torch.get_rng_state(),
                 "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
            position=trainer.state.position(),
            progress=trainer.state.progress())
    return state


def restore_training_state(trainer, state: dict) -> None:
    """Puts back everything :func:`training_state` saved, so that training continues where it stopped."""
    config = trainer.config
    if state["model_name"] != config.model.name:
        raise GpuaccelError(f"the checkpoint was made for model {state['model_name']!r}, not {config.model.name!r}")
    try:
        trainer.strategy.load_state(trainer.optimizer, state["model"], state["optimizer"])
    except (RuntimeError, KeyError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise GpuaccelError(f"the checkpoint does not fit model {config.model.name!r}: {first}") from None
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.scaler.load_state_dict(state["scaler"])
    if trainer.ema is not None and state.get("ema"):
        trainer.ema.load_state_dict(state["ema"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"][:torch.cuda.device_count()])
    trainer.state.load(state["position"], state["progress"])
