"""Checkpoints: what they hold (:func:`training_state`) and how a trainer takes it back
(:func:`restore_training_state`); resuming a run is resume.py's.

The file's form is the one both doors write (``runtime/state.py``): a header and named states,
written atomically (the old file or the new one, never half of one).
"""

from __future__ import annotations

from pathlib import Path

from ..device import new_host_copy
from ..errors import GpuaccelError
from ..files import atomic_write, write_json  # noqa: F401  (run files are written through these)
from ..runtime.state import FORMAT, VERSION, read_state, rng_state, set_rng_state, write_state  # noqa: F401


def save(path: Path, state: dict) -> None:
    write_state(path, state)


def load(path: Path, map_location="cpu") -> dict:
    """Reads a gpuaccel checkpoint; anything else is a user error, not a traceback."""
    return read_state(path, map_location)


# ---------------------------------------------------------------------- what a checkpoint holds

def training_state(trainer, full: bool, to_host=None) -> dict:
    """What checkpoint.pt (``full``: everything to continue) and model.pt (the model and what
    rebuilding, exporting and inferring with it needs) hold. Where the strategy gathers its state
    (pipelines, and FSDP for model.pt) this is a collective; FSDP's checkpoint.pt names its
    shards folder instead of holding the model and optimizer (``Trainer.save_checkpoint`` writes it).
    ``to_host`` copies the model's and the weight average's tensors to the host where the
    strategy does not gather them (default: ``.cpu()``)."""
    shards = full and trainer.strategy.shards_state  # (the model and optimizer: each process's part, beside)
    model_state, optimizer_state = (None, None) if shards else \
        trainer.strategy.gather_state(trainer.optimizer if full else None, to_host=to_host)
    to_host = to_host or new_host_copy
    inputs, config = trainer.inputs, trainer.config
    state = {"model_name": config.model.name, "model_args": trainer.model_args, "model_path": config.model.model_path,
             "task": trainer.task.describe(), "classes": inputs.classes, "mean": inputs.mean, "std": inputs.std,
             "tokenizer": inputs.tokenizer, "audio": inputs.audio, "ratings": inputs.ratings,
             "data_kind": inputs.data_kind, **inputs.record,
             "data_identity": inputs.identity, "config": config.to_dict(), "model": model_state,
             "ema_model": {k: to_host(v) for k, v in trainer.ema.module.state_dict().items()}
             if trainer.ema else None,
             "accuracy": trainer.state.last_eval.get("accuracy"), "metrics": trainer.state.last_eval,
             "gpuaccel": trainer.version,
             "structure": trainer.structure}
    if full:
        state.update(
            optimizer=optimizer_state, scheduler=trainer.scheduler.state_dict(), scaler=trainer.scaler.state_dict(),
            ema=trainer.ema.state_dict() if trainer.ema else None,
            rng=rng_state(),
            position=trainer.state.position(),
            progress=trainer.state.progress(),
            shards=shards_folder(trainer.state.global_step) if shards else None)
    return state


def shards_folder(step: int) -> str:
    """The folder, beside checkpoint.pt, of a sharded run's model and optimizer shards at ``step``:
    one per checkpoint, so that checkpoint.pt never names shards of another step (the older
    ones go once the newer checkpoint.pt is written)."""
    return f"checkpoint.shards-{step}"


def restore_training_state(trainer, state: dict, folder: Path | None = None) -> None:
    """Puts back everything :func:`training_state` saved, so that training continues where it
    stopped (``folder``: where the checkpoint lies, for a sharded one's shards)."""
    config = trainer.config
    if state["model_name"] != config.model.name:
        raise GpuaccelError(f"the checkpoint was made for model {state['model_name']!r}, not {config.model.name!r}")
    try:
        if state.get("shards"):  # each process reads its part (resharded if the processes changed)
            shards = Path(folder or ".") / state["shards"]
            if not shards.is_dir():
                raise GpuaccelError(f"the checkpoint's shards ({shards}) are missing; the run cannot resume")
            trainer.strategy.load_shards(shards, trainer.optimizer)
        else:
            trainer.strategy.load_state(trainer.optimizer, state["model"], state["optimizer"])
    except (RuntimeError, KeyError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise GpuaccelError(f"the checkpoint does not fit model {config.model.name!r}: {first}") from None
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.scaler.load_state_dict(state["scaler"])
    if trainer.ema is not None and state.get("ema"):
        trainer.ema.load_state_dict(state["ema"])
    set_rng_state(state["rng"])
    trainer.state.load(state["position"], state["progress"])
