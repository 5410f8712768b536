"""The background process that compiles a run's model for the runs after it.

A short run on a machine that never compiled its model would spend most of its command
compiling (docs/results.md, "Cold start"). With ``--compile-background`` (the default) such a
run trains uncompiled, its step still one CUDA graph, and starts this module's :func:`main` in a
process of its own (warmup.py, ``gpuaccel.compiling.start_background_compile``): it rebuilds the
run from its settings, runs the run's start up to and through the warm-up (which compiles,
filling the compile caches) and exits; the next run with the same settings loads the compiled
graphs from the cache. Nothing in gpuaccel imports this module: it imports the Trainer.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from .config import TrainConfig
from .progress import Progress
from .trainer import Trainer


def main(argv: list[str] | None = None) -> None:
    """``argv``: the note's path (gpuaccel.compiling.CompiledNote): the settings are in NOTE.json,
    and NOTE.compiling, this process's lock, is removed as it ends."""
    note = Path((argv or sys.argv[1:])[0])
    settings = note.with_suffix(".json")
    try:
        config = TrainConfig.from_dict(json.loads(settings.read_text()))
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = Trainer(config.replace(compile_background=False, run_dir=run_dir), quiet=True)
            # the run's own start: the task checked on the first batch (the model's first call,
            # which can change what is traced), then the warm-up, which compiles
            trainer.first_batches(Progress(1, quiet=True))
            print(f"compiled in {trainer.times.warmup_seconds:.1f} s of warm-up "
                  f"(set-up {trainer.times.setup_seconds:.1f} s)")
    finally:
        settings.unlink(missing_ok=True)
        note.with_suffix(".compiling").unlink(missing_ok=True)

