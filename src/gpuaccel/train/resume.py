"""Resuming a run: which settings may change (:data:`RESUME_CHANGEABLE`) and how a trainer is
rebuilt from a run directory and continues from its checkpoint (:func:`resume`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import GpuaccelError
from ..parallel import Distributed
from .checkpoint import load
from .config import TrainConfig, flatten_sections
from .run_dir import CHECKPOINT, RunDirectory

# settings a resumed run may change: where and how it runs, when it stops, what it logs
RESUME_CHANGEABLE = frozenset({
    "epochs", "time_limit", "target", "target_acc", "device", "loader", "workers", "monitor", "profile",
    "tensorboard", "eval_every", "checkpoint_every", "checkpoint_seconds", "checkpoint_epochs", "cache_dir",
    "compile", "compile_background", "activation_checkpointing", "overlap_gradients", "shard_unit_mb"})


def resumed_config(config, state: dict, overrides: dict, run_dir) -> tuple:
    """(the config a resumed run continues with, what it changes: {setting: (old, new)}).
    Only :data:`RESUME_CHANGEABLE` settings may change; the model and data stay the run's."""
    from ..data import resolved_spec

    overrides = dict(overrides or {})
    if overrides.get("target_acc") is not None:  # the older spelling of --target
        overrides["target"], overrides["target_acc"] = f"accuracy={overrides['target_acc']:g}", None
    if "data" in overrides and resolved_spec(overrides["data"]) == config.data.source:
        overrides["data"] = config.data.source  # the same data, spelled another way
    for key, value in overrides.items():
        if key == "model" and value != state["model_name"]:
            raise GpuaccelError(f"{run_dir} holds a checkpoint of model {state['model_name']!r}, not {value!r}; "
                                f"resume without --model or start a new run")
        if config.get(key) != value and key not in RESUME_CHANGEABLE:
            raise GpuaccelError(f"--{key.replace('_', '-')} cannot change when resuming "
                                f"(changeable: {', '.join(sorted(RESUME_CHANGEABLE))})")
    changed = {k: (config.get(k), v) for k, v in overrides.items()
               if k in RESUME_CHANGEABLE and config.get(k) != v}
    return config.replace(**{k: v for k, v in overrides.items() if k in RESUME_CHANGEABLE}), changed


def saved_config(run_dir: Path, state: dict) -> tuple[TrainConfig, str | None]:
    """The run's settings and what was wrong with config.json (None: nothing). The checkpoint
    holds the settings the run was trained with and is the authority for them: config.json
    adds only the settings a resume may change (a resume writes those there), so a config.json
    with keys missing, other values, or none at all (a hand edit, a disk fault) changes
    nothing. A checkpoint without a copy (written by an early gpuaccel) leaves config.json."""
    path = run_dir / "config.json"
    recorded = state.get("config") if isinstance(state.get("config"), dict) else None
    try:
        written = json.loads(path.read_text())
        if not isinstance(written, dict):
            raise ValueError("not a mapping of settings")
        written = flatten_sections(written)  # (unknown keys: damaged; compared below by flat name)
    except FileNotFoundError:
        written, problem = None, "is missing"
    except (ValueError, TypeError, AttributeError, GpuaccelError) as exc:  # not JSON, or not a config
        written, problem = None, f"is damaged ({str(exc).splitlines()[0][:120]})"
    else:
        problem = None
    if recorded is None:
        if written is None:
            raise GpuaccelError(f"{path} {problem} and {CHECKPOINT} holds no copy of the settings; restore "
                                f"config.json or start a new run")
        return TrainConfig.from_dict(written), None
    if written is None:
        return TrainConfig.from_dict(recorded), problem
    recorded = flatten_sections(recorded)  # (nested, or flat as runs before the nested config wrote it)
    same = json.loads(json.dumps(recorded, default=str))  # (compared as config.json spells values)
    missing = sorted(k for k in same if k not in written)
    differ = sorted(k for k in same if k in written and written[k] != same[k] and k not in RESUME_CHANGEABLE)
    settings = {**recorded, **{k: v for k, v in written.items() if k in RESUME_CHANGEABLE}}
    if missing or differ:
        problem = "; ".join(part for part in (
            f"lacks {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}" if missing else "",
            f"differs from the checkpoint in {', '.join(differ[:8])}" if differ else "") if part)
    return TrainConfig.from_dict(settings), problem


def resume(trainer_class, run_dir, *, overrides: dict | None = None, quiet: bool = False, model=None,
           train_data=None, eval_data=None, task=None, loss_fn=None, metrics=None):
    """``Trainer.resume``: the trainer of ``run_dir`` rebuilt from its config.json (with the
    ``overrides`` a resume may make), its checkpoint loaded, the run directory locked and
    mended (a half-written file removed, evaluations after the checkpoint dropped)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise GpuaccelError(f"resume directory {run_dir} does not exist")
    if not (run_dir / CHECKPOINT).exists():
        raise GpuaccelError(f"{run_dir} holds no gpuaccel checkpoint to resume ({CHECKPOINT})")
    run = RunDirectory(run_dir, writer=Distributed.from_env().is_main)
    run.lock()
    try:
        state = load(run_dir / CHECKPOINT)
        saved, damaged = saved_config(run_dir, state)
        config, changed = resumed_config(saved, state, overrides, run_dir)
        if model is not None and not config.model.name.startswith("object:"):
            raise GpuaccelError(f"{run_dir} trained model {config.model.name!r}, which it rebuilds itself; resume "
                                f"without model=")
        trainer = trainer_class(config, model=model, train_data=train_data, eval_data=eval_data, task=task,
                                loss_fn=loss_fn, metrics=metrics, structure=state.get("structure"), data_init=False,
                                quiet=quiet)
        trainer.inputs.check_same(state.get("data_identity"), run_dir)
        trainer.load_state(state, run_dir)
    except BaseException:
        run.unlock()
        raise
    trainer.continue_in(run)
    if run.writer:
        if damaged:
            run.write_config(trainer.config.to_dict())
            if not quiet:
                print(f"gpuaccel: warning: {run_dir / 'config.json'} {damaged}; resuming with the settings "
                      f"{CHECKPOINT} holds (config.json rewritten)", file=sys.stderr)
        if changed:  # config.json says what the rest of the run uses; the change is said once
            run.write_config(trainer.config.to_dict())
            if not quiet:
                print("gpuaccel: resuming with " + ", ".join(
                    f"--{k.replace('_', '-')} {new} (was {old})" for k, (old, new) in changed.items()) +
                    ("; the learning-rate schedule is re-planned for the new length" if "epochs" in changed
                     else "") + "; config.json updated", file=sys.stderr)
        if not quiet:
            print(f"gpuaccel: resuming {run_dir} from step {trainer.state.global_step:,} "
                  f"(epoch {trainer.epochs_done:.2f} of {trainer.config.loop.epochs:g}, "
                  f"{trainer.state.train_seconds:.1f} s trained)", file=sys.stderr)
        run.write_position(trainer.state.position())
        # evaluations logged after the checkpoint are redone, and a line torn by a crash goes:
        # the log stays one line per evaluation
        run.metrics.repair(keep=lambda r: r.get("step", 0) <= trainer.state.global_step)
    return trainer


def run_to_continue(resume: str | None, run_dir: str | None) -> str | None:
    """The run a process continues: ``resume`` if given, else (when torchrun's elastic agent has
    restarted the process group after a failure) the run directory if it holds a checkpoint."""
    if resume:
        return resume
    if Distributed.from_env().restart > 0 and run_dir and (Path(run_dir) / CHECKPOINT).exists():
        return run_dir
    return None
