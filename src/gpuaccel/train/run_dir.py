"""A run's directory: where it is, who may write it, and the files in it.

    config.json      the settings (TrainConfig, resolved)
    metrics.jsonl    one record per evaluation
    checkpoint.pt    everything to continue the run (checkpoint.json: a readable copy of where it stands)
    model.pt         the trained model (the last weights)
    best.pt          the best evaluation's weights, where that was not the last one (by the
                     target's metric, else the task's main one; summary.json's best_model)
    summary.json     what ``fit`` returned
    gpu*.jsonl       GPU samples (``--monitor``)

One process trains in it at a time: rank 0 holds a lock for all of them, and what a killed
process left half-written is removed when the next one takes it.
"""

from __future__ import annotations

import shutil
from datetime import datetime
from pathlib import Path

from ..errors import GpuaccelError
from ..files import MetricsFile, RunLock, make_directory, new_directory, remove_stale_temporaries
from . import checkpoint

CHECKPOINT = "checkpoint.pt"
FINAL_MODEL = "model.pt"
BEST_MODEL = "best.pt"


class RunDirectory:
    def __init__(self, path: Path, *, writer: bool):
        """``writer``: this process writes the files (rank 0); the others only read the path."""
        self.path, self.writer = Path(path), writer
        self._lock: RunLock | None = None

    @classmethod
    def create(cls, where: str | None, data_name: str, model: str, *, writer: bool) -> "RunDirectory":
        """``where``, or runs/<data>-<model>-<date>-<time> (with ~2, ~3 ... if taken); refuses a
        directory that holds a run already."""
        if where:
            path = Path(where)
        else:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            path = Path("runs") / f"{data_name}-{model.replace(':', '_').replace('/', '_')}-{stamp}"
            if writer:
                path = new_directory(path)
        run = cls(path, writer=writer)
        if writer:
            make_directory(path)
            run.lock()
            if (path / CHECKPOINT).exists():
                run.unlock()
                raise GpuaccelError(f"{path} already holds a run; continue it with --resume {path} or pick another "
                                    f"--run-dir")
        return run

    def lock(self) -> None:
        """Takes the directory for this run (a no-op where it is held already, or on other ranks)."""
        if self.writer and self._lock is None:
            self._lock = RunLock(self.path).acquire()
            remove_stale_temporaries(self.path)

    def unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @property
    def metrics(self) -> MetricsFile:
        return MetricsFile(self.path / "metrics.jsonl")

    def write_config(self, settings: dict) -> None:
        if self.writer:
            checkpoint.write_json(self.path / "config.json", settings)

    def save_checkpoint(self, state: dict, position: dict) -> None:
        """checkpoint.pt, then checkpoint.json, its readable position (checkpoint.pt is the truth;
        a kill between the two writes is mended when the run resumes)."""
        if self.writer:
            checkpoint.save(self.path / CHECKPOINT, state)
            self.write_position(position)
            for older in self.path.glob("checkpoint.shards-*"):  # (a sharded run's: those of earlier checkpoints)
                if older.name != state.get("shards") and older.is_dir():
                    shutil.rmtree(older, ignore_errors=True)

    def write_position(self, position: dict) -> None:
        if self.writer:
            checkpoint.write_json(self.path / "checkpoint.json", position)

    def save_model(self, state: dict) -> None:
        if self.writer:
            checkpoint.save(self.path / FINAL_MODEL, state)

    def save_best(self, state: dict) -> None:
        if self.writer:
            checkpoint.save(self.path / BEST_MODEL, state)

    def remove_best(self) -> None:
        if self.writer:
            (self.path / BEST_MODEL).unlink(missing_ok=True)

    def write_summary(self, summary: dict) -> None:
        if self.writer:
            checkpoint.write_json(self.path / "summary.json", summary)

    def __str__(self) -> str:
        return str(self.path)
