"""Compiling a run's model in a background process, for the runs after it.

A short run on a machine that never compiled its model would spend most of its command
compiling (docs/results.md, "Cold start"). With ``--compile-background`` (the default) such a
run trains uncompiled, its step still one CUDA graph, and leaves the compile to a process of its
own (:func:`main`) rebuilds the run from its settings, runs its start up to the warm-up (which
compiles, filling the compile caches) and exits; the next run with the same
settings loads the compiled graphs from the cache. The process is niced, runs in a session of
its own (it outlives the command that started it), writes its output to ``NOTE.log`` and holds
``NOTE.compiling`` (gpuaccel.compiling.CompiledNote) while it runs, so that a second run does not
start another.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CHILD = "from gpuaccel.train.precompile import main; main()"
# what the background process needs on the GPU beyond what this process reserved at its peak
# (its own CUDA context, and room for Inductor's autotuning)
SPARE_BYTES = 1 << 30


def compile_in_background(trainer, note) -> bool:
    """Starts the background compile of ``trainer``'s graphs (``note``: their CompiledNote), or
    finds one running; False where it cannot: the GPU lacks the memory for a second copy of the
    step (measured after the warm-up's first steps), or the cache folder cannot be written."""
    device = trainer.device
    free, _ = torch.cuda.mem_get_info(device)
    if free < torch.cuda.max_memory_reserved(device) + SPARE_BYTES:
        return False
    try:
        if not note.claim():
            return True  # another run's process compiles the same graphs
    except OSError:
        return False
    try:
        note.path.with_suffix(".json").write_text(json.dumps(trainer.config.to_dict(), default=str))
        with open(note.path.with_suffix(".log"), "w") as log:
            process = subprocess.Popen([sys.executable, "-c", CHILD, str(note.path)],
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        note.hand_over(process.pid)
    except OSError:
        note.lock.unlink(missing_ok=True)
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    from ..caches import use_bytecode_cache
    from .config import TrainConfig
    from .progress import Progress
    from .trainer import Trainer

    note = Path((argv or sys.argv[1:])[0])
    settings = note.with_suffix(".json")
    try:
        try:
            os.nice(10)  # (the run that started it trains meanwhile)
        except OSError:
            pass
        use_bytecode_cache()
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


if __name__ == "__main__":
    main()
