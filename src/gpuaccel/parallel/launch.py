"""``gpuaccel train --gpus N``: N training processes on this machine, started by PyTorch's
elastic launcher (torch.distributed.run, i.e. torchrun), which also restarts the group
after a failure (``--max-restarts``); the restarted processes resume from the run's last
checkpoint. Across machines, run torchrun yourself (see the README); the training code
is the same.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import torch

from ..errors import GpuaccelError

_LAUNCHER_OPTIONS = ("--gpus", "--max-restarts")


def worker_arguments(argv: list[str], run_dir: str) -> list[str]:
    """The ``gpuaccel train`` arguments for each process: the launcher's own options removed,
    a fixed run directory added (a restarted group must find its checkpoint), except for a
    resume, which continues in the run's own directory."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _LAUNCHER_OPTIONS:
            skip = "=" not in arg
            continue
        out.append(arg)
    if not any(a.split("=", 1)[0] in ("--run-dir", "--resume") for a in out):
        out += ["--run-dir", run_dir]
    return out


def launch(argv: list[str], gpus: int, max_restarts: int, run_dir: str | None, model: str,
           pipeline_stages: int = 1) -> int:
    """Runs ``gpuaccel train argv`` in ``gpus`` processes under torch.distributed.run; returns
    the exit status."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 1:
        raise GpuaccelError(f"--gpus must be at least 1, got {gpus}")
    if gpus % pipeline_stages:
        raise GpuaccelError(f"--gpus {gpus} does not split into pipelines of --pipeline-stages {pipeline_stages}")
    if gpus > available:
        raise GpuaccelError(f"--gpus {gpus} asks for more GPUs than present ({available} visible to PyTorch)")
    if max_restarts < 0:
        raise GpuaccelError(f"--max-restarts must be >= 0, got {max_restarts}")
    run_dir = run_dir or str(Path("runs") / f"{model.replace(':', '_').replace('/', '_')}-{gpus}gpu-"
                                              f"{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    args = ["--standalone", f"--nproc-per-node={gpus}", f"--max-restarts={max_restarts}",
            "--module", "gpuaccel", "train", *worker_arguments(argv, run_dir)]
    try:
        torchrun(args)
    except ChildFailedError as exc:
        first = next(iter(exc.failures.values()), None)
        code = first.exitcode if first is not None else 1
        return code if code and code > 0 else 1
    return 0
