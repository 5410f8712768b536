"""The processes of one multi-process run, for tests that check what the processes compute
together (several processes train like one), not how they are launched.

torchrun starts a launcher and then each worker as a new interpreter: on a 2-core CPU about
6 s per launch of imports alone (PyTorch in the launcher and in each worker, Dynamo at each
worker's first optimizer step), most of a test that trains for a second. Here each process is
forked from one server process that imported them once for the whole session (multiprocessing's
forkserver: nothing has run in it but the imports), with the environment torchrun gives a
worker (RANK, WORLD_SIZE, LOCAL_RANK, the rendezvous address, one OpenMP thread). Tests of the
launcher itself (restarts, a killed launcher, one process's error stopping the others, --gpus,
Slurm) start torchrun.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
from pathlib import Path

# imported once in the server (each a few seconds on a small CPU); the tests' helpers with them
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "gpuaccel.cli", "gpuaccel.train.trainer", "plain_models"]


def _context():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process(program: list[str], args: list[str], env: dict[str, str], output: str) -> None:
    """One process: its output into ``output``, the environment set, then ``python -m gpuaccel``'s
    or a script's main as the command line would run it (each ends the process itself, or returns)."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)  # (as OMP_NUM_THREADS=1, which torchrun sets; OpenMP read it in the server)
    if program[:2] == ["-m", "gpuaccel"]:
        from gpuaccel.cli import run

        sys.argv = ["gpuaccel", *program[2:], *args]
        run()
    else:
        sys.argv = [program[0], *args]
        sys.path.insert(0, str(Path(program[0]).parent))
        runpy.run_path(program[0], run_name="__main__")
    sys.stdout.flush()
    sys.stderr.flush()


def run_processes(*args: str, nproc: int = 2, program=("-m", "gpuaccel", "train"), env: dict | None = None,
                  exit_codes: list[int] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs ``program`` (``-m gpuaccel train`` or a script's path) with ``args`` in ``nproc``
    processes of one process group, as torchrun's workers, with ``env`` added to their
    environment; fails with each process's output unless they exit with ``exit_codes`` (0 each by
    default). Returns the outputs, rank after rank, as ``stdout``, and the largest exit code."""
    context = _context()
    port = free_port()
    outputs = [Path(os.environ.get("TMPDIR", "/tmp")) / f"rank{rank}-{port}.log" for rank in range(nproc)]
    processes = []
    for rank in range(nproc):
        worker_env = {**(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                      "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "TORCHELASTIC_RESTART_COUNT": "0",
                      "TORCHELASTIC_MAX_RESTARTS": "0"}
        process = context.Process(target=_process, args=(list(program), list(args), worker_env, str(outputs[rank])))
        process.start()
        processes.append(process)
    for process in processes:
        process.join(timeout)  # (one still running then is killed; the outputs show where each one was)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    text = "".join(path.read_text(errors="replace") for path in outputs)
    for path in outputs:
        path.unlink()
    codes = [process.exitcode for process in processes]
    assert codes == (exit_codes or [0] * nproc), f"exit codes {codes}:\n{text[-6000:]}"
    return subprocess.CompletedProcess(list(program) + list(args), max(codes), stdout=text, stderr="")
